"""ZeRO-3 model-state bytes one rank holds, counted from a DeepSpeed engine, and DeepSpeed's estimate.

Model states are what ZeRO partitions: the parameters (in the training dtype), their
gradients, the fp32 master weights and the optimizer's moments. Each storage is counted once
(fp32 master weights that are the parameter partitions themselves, as after
`metaseq_ds.optim.fp32_master_weights.share_fp32_master_weights`, add nothing), after a step,
when the gathered full parameters have been released again.
"""

from typing import Dict

import torch

from metaseq_ds.private_apis.deepspeed_optimizers import zero3_flat_partitions, zero3_gradient_buffer


def model_state_bytes(engine) -> Dict[str, int]:
    """{"params", "grads", "master", "optimizer", "total"}: bytes of each kind this rank holds,
    and the model's "total_params" and "largest_layer_params", as DeepSpeed's estimator counts them."""
    zero = engine.optimizer
    seen = set()

    def bytes_of(tensors) -> int:
        total = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.numel() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    counts = {
        "params": bytes_of(p.ds_tensor for p in engine.module.parameters()),
        "grads": bytes_of([zero3_gradient_buffer(zero)]),
        "master": bytes_of(master for master, _ in zero3_flat_partitions(zero)),
        "optimizer": bytes_of(
            value for state in zero.optimizer.state.values() for value in state.values() if torch.is_tensor(value)
        ),
    }
    counts["total"] = sum(counts.values())
    return {**counts, **parameter_counts(engine.module)}


def parameter_counts(module: torch.nn.Module) -> Dict[str, int]:
    """DeepSpeed's `model_to_params` on a ZeRO-3 module, whose partitioned parameters have
    numel() 0: shared parameters count once, and a layer is one module's own parameters."""
    total = sum(p.ds_numel for p in module.parameters())  # parameters() yields a shared one once
    largest = max(sum(p.ds_numel for p in m.parameters(recurse=False)) for m in module.modules())
    return {"total_params": total, "largest_layer_params": largest}


def exact_state_bytes(total_params: int, dtype: str) -> int:
    """Bytes of model states for the whole model, all ranks together, as DeepSpeed keeps them
    between steps: parameters and gradients in the training dtype, fp32 master weights (the
    parameters themselves in fp32) and Adam's two fp32 moments. 16 bytes a parameter either way."""
    low = 2 if dtype == "bf16" else 4
    master = 4 if dtype == "bf16" else 0
    return total_params * (low + low + master + 8)


def estimated_bytes(total_params: int, largest_layer_params: int, ranks: int) -> Dict[str, int]:
    """DeepSpeed's `estimate_zero3_model_states_mem_needs` (no offload) for `ranks` ranks on one node.

    Its per-device figure is 18 bytes per parameter over the ranks (2 + 2 for bf16/fp16 parameters
    and gradients, 4 + 4 + 4 for fp32 master weights and Adam's two moments, 2 spare) plus one
    gathered fp32 copy of the largest layer. The partitioned part is what a rank keeps between
    steps; the largest layer is gathered only while it runs.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, device_bytes, largest_layer_bytes = estimate_zero3_model_states_mem_needs(
        total_params, largest_layer_params, num_gpus_per_node=ranks, cpu_offload=False, cpu_offload_params=False
    )
    partitioned = device_bytes - largest_layer_bytes
    return {"total": device_bytes, "partitioned": partitioned, "largest_layer": largest_layer_bytes}
