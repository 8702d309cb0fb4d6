"""ZeRO's gradient reduction and optimizer step without transient copies of whole gradients.

    lean_zero_step(engine)  # right after deepspeed.initialize (and share_fp32_master_weights)

DeepSpeed 0.19's ZeRO-1/2/3 steps first take the gradient norm of every gradient partition
after copying it to fp64 (`g.to(get_norm_dtype())`): a transient twice the largest fp32
partition, four times a bf16 one (206 MB for the tied embedding's partition of a 707M model at
TP=2 x DP=2, the ZeRO-3 step's peak; 412 MB at TP=2 on one data-parallel rank). The norm is
now taken over pieces of at most `NORM_CHUNK_ELEMENTS` (8 MB in fp64; `GPU_NORM_CHUNK_ELEMENTS`,
128 MB, on a GPU, where each piece costs kernel launches: 1.3B parameters in 1,250 pieces would
be ~3,800 launches a step), each still summed in fp64; their squares add up to the same norm.

Then ZeRO-3, sub-group by sub-group, concatenates the sub-group's gradient partitions, which
already lie one after another in its flat gradient buffer, into a new tensor for the
optimizer: in fp32 training a copy of up to a sub-group (12 d*d elements: 200 MB at width
2048). In fp32 the optimizer now reads them in the buffer. bf16 and fp16 training need that
copy: it converts them to fp32.

Before the step, in the backward, ZeRO-3 buckets gradients for their reduce-scatter but finds
a bucket full only when the next gradient would not fit, so a gradient larger than the bucket
(a layer's FFN matrices, unless tensor parallelism cuts them below d*d) stayed whole through the
next module's backward. A full bucket is now reduced at once.

ZeRO-1/2's step, having checked the global norm once, read its validity from the device again
for each optimizer group it clipped (a host sync a group: ~26 an update at OPT-1.3b, in groups
of about a layer); it now clips on the device.

ZeRO-0 in bf16 or fp16 steps through DeepSpeed's `FP16_UnfusedOptimizer`, which asks each
gradient in turn whether it holds an inf or NaN (a read of the device each: a host sync per
parameter on a GPU, ~390 a step at OPT-1.3b) and takes each gradient's norm from another fp32
copy. Its step now reads the device once: one norm of the fp32 gradients decides overflow,
and clipping scales by it on the device. And in a one-process world ZeRO-0's backward no longer
all-reduces the gradients (flattened into new buckets, reduced over that one process and copied
back: an identity at the cost of a copy of them all, 1-2% of the CPU benchmark's step).
"""

from typing import Optional

NORM_CHUNK_ELEMENTS = 2**20
GPU_NORM_CHUNK_ELEMENTS = 2**24


def lean_zero_step(engine, norm_chunk_elements: Optional[int] = None) -> bool:
    """These changes where they apply: ZeRO-1/2/3 without optimizer offload (whose step reads
    offloaded gradients another way), ZeRO-0's step in bf16 or fp16 and its all-reduce in one
    process; whether anything was changed.
    `norm_chunk_elements`: by default by the engine's device (see above)."""
    from metaseq_ds.private_apis import deepspeed_optimizers as zero

    stage = engine.zero_optimization_stage()
    if stage == 0:
        mixed_precision = engine.bfloat16_enabled() or engine.fp16_enabled()
        one_read = mixed_precision and zero.unfused_step_with_one_read(engine.optimizer)
        return zero.skip_all_reduce_in_one_process(engine) or one_read
    if engine.zero_cpu_offload():
        return False
    if norm_chunk_elements is None:
        norm_chunk_elements = NORM_CHUNK_ELEMENTS if engine.device.type == "cpu" else GPU_NORM_CHUNK_ELEMENTS
    zero.zero_gradient_norms_in_pieces(engine.optimizer, norm_chunk_elements)
    if stage in (1, 2):
        zero.zero12_clip_on_the_device(engine.optimizer)
    if stage == 3:
        zero.zero3_step_on_the_gradient_buffer(engine.optimizer)
        zero.zero3_reduce_full_buckets_at_once(engine.optimizer)
    return True
