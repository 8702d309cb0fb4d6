"""`mseq train --dry-run`: what each rank will hold, from the flags alone, before a job starts.

    mseq train --dry-run --arch opt_175b --distributed-world-size 1024 --model-parallel-size 8 \
        --zero-stage 3 --bf16 --batch-size 1 --tokens-per-sample 2048 --final-vocab-size 50272

The model is built on the meta device (shapes only: nothing is allocated), the tensor-parallel
plan says which parameters each rank holds a 1/T slice of, and the ZeRO stage says what is
partitioned over the D = ranks / T data-parallel ranks. Bytes per rank:

- weights: this rank's tensor-parallel share x 2 (bf16/fp16) or 4 (fp32), / D under ZeRO-3;
- gradients: the same size, / D from ZeRO-2 on;
- optimizer: Adam's two fp32 moments (8 bytes) plus an fp32 master copy (4 bytes) in bf16/fp16
  (in fp32 the master copy is the weights themselves: `optim.fp32_master_weights`), / D from
  ZeRO-1 on;
- activations of one micro-batch: an estimate after Korthikanti et al. (2022), s*b*h*(10 + 24/T)
  bytes a layer at 2 bytes an element, without the s^2 attention term (SDPA's fused kernels keep
  none), or one layer's input a layer with --checkpoint-activations; plus the loss: the logits
  (s*b*V/T) where they are made (ZeRO-3 streaming a tied embedding over several data-parallel
  ranks, unless activations are recomputed without tensor parallelism), else what the fused
  projection and loss hold (one chunk of fp32 logits, the features' gradient and the gradient of
  the projection's weight, or of its vocabulary shard under tensor parallelism, or of this rank's
  ZeRO-3 partition of a streamed tied embedding, made in the forward).

DeepSpeed's own `estimate_zero3_model_states_mem_needs` is printed beside the ZeRO-3 figure (it
assumes fp16 mixed precision: 18 bytes a parameter plus its largest layer in fp32).
"""

import dataclasses
from typing import Dict, List

import torch

from metaseq_ds.errors import UsageError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    world_size: int
    tensor_parallel_size: int
    zero_stage: int
    precision: str
    parameters: int  # the whole model
    tp_share_parameters: int  # what one rank's tensor-parallel slice holds
    largest_parameter: int  # elements of the largest tensor-parallel slice of one parameter
    layer_parameters: int  # one decoder layer's tensor-parallel share: what ZeRO-3 gathers at a time
    per_rank: Dict[str, float]  # bytes

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size

    @property
    def total(self) -> float:
        return sum(self.per_rank.values())


def plan_memory(cfg, world_size: int) -> MemoryPlan:
    """The plan of `cfg` on `world_size` ranks (nothing allocated: the model lives on the meta device)."""
    from metaseq_ds import tasks
    from metaseq_ds.distributed.deepspeed_config import resolve_zero_stage
    from metaseq_ds.distributed.tensor_parallel import partition_dim, tensor_parallel_size

    if "decoder_embed_dim" not in cfg.model.__dataclass_fields__:
        raise UsageError(f"--dry-run sizes transformer_lm models; --arch {cfg.arch} is not one")
    tp = tensor_parallel_size(cfg)
    stage = resolve_zero_stage(cfg, world_size)
    dp = world_size // tp
    task = tasks.setup_task(dataclasses.replace(cfg.task, data=None))  # sizes only: no data is read
    with torch.device("meta"):
        model = task.build_model(cfg.model)
    whole = share = largest = layer = 0
    for name, param in model.named_parameters():
        sliced = param.numel() // tp if tp > 1 and partition_dim(name) is not None else param.numel()
        whole += param.numel()
        share += sliced
        largest = max(largest, sliced)
        layer += sliced if name.startswith("decoder.layers.0.") else 0
    low_precision = cfg.common.bf16 or cfg.common.fp16
    element = 2 if low_precision else 4
    master = 4 if low_precision else 0
    per_rank = {
        "weights": share * element / (dp if stage == 3 else 1),
        "gradients": share * element / (dp if stage >= 2 else 1),
        "optimizer": share * (8 + master) / (dp if stage >= 1 else 1),
        "activations": _activation_bytes(cfg, tp, element, len(model.decoder.layers))
                       + _loss_bytes(cfg, model.decoder, tp, dp, element, streamed_tie=stage == 3 and dp > 1),
    }
    precision = "bf16" if cfg.common.bf16 else "fp16" if cfg.common.fp16 else "fp32"
    return MemoryPlan(world_size, tp, stage, precision, whole, share, largest, layer, per_rank)


def _activation_bytes(cfg, tp: int, element: int, layers: int) -> float:
    s, b, h = cfg.task.tokens_per_sample, cfg.dataset.batch_size, cfg.model.decoder_embed_dim
    per_layer = s * b * h * (10 + 24 / tp) * element / 2
    if cfg.distributed_training.checkpoint_activations:
        kept = layers * s * b * h * element + per_layer  # each layer's input, and one layer recomputed
    else:
        kept = layers * per_layer
    return kept


def _loss_bytes(cfg, decoder, tp: int, dp: int, element: int, streamed_tie: bool) -> float:
    """The output projection and loss: see the module's docstring (`TransformerDecoder.output_loss`)."""
    from metaseq_ds.modules.cross_entropy import CHUNK_ELEMENTS

    vocab, width = decoder.output_projection.weight.shape
    vocab /= tp  # a rank's shard
    tokens = cfg.task.tokens_per_sample * cfg.dataset.batch_size
    tied = decoder.output_projection.weight is decoder.embed_tokens.weight
    chunk = min(CHUNK_ELEMENTS, tokens * vocab) * 4
    if tied and streamed_tie:
        if tp > 1 or not cfg.distributed_training.checkpoint_activations:
            return tokens * vocab * element
        # the features' gradient in fp32, and W's in fp32 for this rank's partition
        return chunk + tokens * width * 4 + vocab * width / dp * 4
    return chunk + tokens * width * element + vocab * width * element


def deepspeed_zero3_estimate(plan: MemoryPlan) -> float:
    """DeepSpeed's estimate of a ZeRO-3 rank's model states (no offload) for this plan."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    _, device_bytes, _ = estimate_zero3_model_states_mem_needs(
        total_params=plan.tp_share_parameters, largest_layer_params=plan.largest_parameter,
        num_gpus_per_node=plan.data_parallel_size, num_nodes=1, cpu_offload=False, zero_init=True)
    return device_bytes


def describe(plan: MemoryPlan, arch: str) -> List[str]:
    model_states = plan.per_rank["weights"] + plan.per_rank["gradients"] + plan.per_rank["optimizer"]
    lines = [
        f"{arch}: {plan.parameters:,} parameters ({plan.parameters / 1e9:.2f}B); {plan.world_size} rank(s) = "
        f"{plan.data_parallel_size} data-parallel x {plan.tensor_parallel_size} tensor-parallel, ZeRO-{plan.zero_stage}, "
        f"{plan.precision}",
        f"  tensor-parallel share: {plan.tp_share_parameters:,} parameters a rank before ZeRO "
        f"(largest single slice {plan.largest_parameter:,})",
        "  per rank:",
    ]
    for name, value in plan.per_rank.items():
        note = " (estimate, one micro-batch)" if name == "activations" else ""
        lines.append(f"    {name:<12}{value / GIB:>12.2f} GiB{note}")
    lines.append(f"    {'total':<12}{plan.total / GIB:>12.2f} GiB")
    if plan.zero_stage == 3:
        ours = model_states + 4 * plan.largest_parameter
        theirs = deepspeed_zero3_estimate(plan)
        lines.append(f"  ZeRO-3 model states + the largest slice gathered in fp32: {ours / GIB:.2f} GiB; DeepSpeed's "
                     f"estimate_zero3_model_states_mem_needs: {theirs / GIB:.2f} GiB (it counts 18 bytes a parameter)")
        layer = plan.layer_parameters * (4 if plan.precision == "fp32" else 2)
        lines.append(f"  ZeRO-3 gathers a layer at a time: {layer / GIB:.2f} GiB on a CPU rank; on a GPU also the "
                     f"next one, prefetched during this one: {2 * layer / GIB:.2f} GiB")
    return lines
