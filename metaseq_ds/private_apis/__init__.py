"""Every private DeepSpeed and torch API metaseq_ds uses, and every patch of upstream behaviour,
by what it touches; nothing else in metaseq_ds reaches into DeepSpeed's or torch's internals.

    verified                   `@relies_on`: version, reason, CUDA, test and canary of each (the record)
    torch_ops                  torch's private operators and tables
    deepspeed_tensor_parallel  DeepSpeed's TP groups and layers
    deepspeed_comm             DeepSpeed's communication backend, its CPU shared-memory all-reduce
    deepspeed_optimizers       ZeRO-1/2/3 and the fp16/bf16 optimizer: flat partitions, lean steps
    deepspeed_checkpoints      DeepSpeed's checkpoint files and its engine's loader

The CPU-only patches of public behaviour live beside what they serve and carry the same record:
`host_memory` (glibc's heap) and `distributed.gloo_collectives`. Public upstream APIs
(deepspeed.initialize, DeepSpeed's TP layers, zero_to_fp32's public functions, torch.load) are
used directly where they are needed. Each module imports only upstream and `verified`.
"""
