"""ZeRO in fp32 without a second copy of the parameters as "fp32 master weights".

DeepSpeed's ZeRO optimizers keep fp32 master partitions next to the training-dtype
parameter partitions. When the parameters already are fp32, ZeRO-3 means to reuse them (stage3.py,
`_create_fp32_partitions`), but it compares a tensor's `torch.device` with the accelerator's
device *name* (`device('cpu') == 'cpu'` is False); ZeRO-1/2 (stage_1_and_2.py) always clone.
So in 0.19 every fp32 run keeps two copies: 20 bytes of model state per parameter instead of 16. `share_fp32_master_weights(engine)`,
called right after `deepspeed.initialize`, points each master partition at the parameter
partition's storage. The master tensors stay the same objects (the optimizer state, the
parameter ids of checkpoints and DeepSpeed's own bookkeeping are keyed by them), the
optimizer then updates the parameters in place, and DeepSpeed's copy from master to
parameters after each step becomes a copy onto itself.
"""


def share_fp32_master_weights(engine) -> int:
    """Alias the fp32 master partitions of a ZeRO-1/2/3 engine to its fp32 parameter partitions;
    returns the bytes freed.

    A no-op (0) unless the engine runs ZeRO with fp32 parameters and without optimizer offload.
    """
    stage = engine.zero_optimization_stage()
    if stage == 0 or engine.zero_cpu_offload():
        return 0
    from metaseq_ds.private_apis import deepspeed_optimizers as zero

    pairs = (zero.zero3_flat_partitions if stage == 3 else zero.zero12_flat_partitions)(engine.optimizer)
    freed = 0
    for master, partition in pairs:
        layout = (master.dtype, master.device, master.shape)
        same_layout = layout == (partition.dtype, partition.device, partition.shape)
        if same_layout and master.untyped_storage().data_ptr() != partition.untyped_storage().data_ptr():
            freed += master.untyped_storage().nbytes()
            master.data = partition.data
    if freed and stage < 3:
        zero.relink_zero12_master_fragments(engine.optimizer)
    return freed
