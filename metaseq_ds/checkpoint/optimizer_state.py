"""The optimizer side of resharding: a checkpoint's fp32 master weights, Adam moments and step,
per parameter and consolidated, read from any saved layout and set on an engine of any layout.

    saved = read_optimizer_state(ref)            # lazy: a value is read when a parameter asks for it
    restore_optimizer_state(trainer, saved)      # each rank: its tensor-parallel slice, its ZeRO partition

One path for every pair of layouts. Reading, chosen by what the checkpoint's meta file says:
- ZeRO-1/2/3: each tensor-parallel rank's flat partitions, consolidated by DeepSpeed's own
  zero_to_fp32 workers, the moments the same way (`private_apis.deepspeed_checkpoints`);
- ZeRO-0: the torch optimizer's state dict in each tensor-parallel rank's model-states file, with
  the weights (fp32) or the fp32 copies of DeepSpeed's fp16/bf16 optimizer as master weights;
- a consolidated checkpoint (`mseq reshard`, `checkpoint.reshard`): its safetensors files;
then the parts of a tensor-parallel save are joined on our partition dimensions (`LazyConcat`).
Setting, after the weights were materialised from the same checkpoint: the base torch optimizer's
state is created as its first step would create it (the step, moments of zeros), then each
parameter's master weights and moments are written through DeepSpeed's public
`safe_set_full_fp32_param`/`safe_set_full_optimizer_state` (ZeRO-1/2/3: each rank keeps its
partition), or at ZeRO-0 into the parameter (fp32) or its fp32 copy (bf16) and the torch
optimizer's state.
Every rank holds one whole parameter at a time, never a state dict.

Why not DeepSpeed's universal checkpoints (`ds_to_universal` + `checkpoint.load_universal`): they
would cover ZeRO-1/2/3 with data parallelism only. They do not read ZeRO-0 saves, and they merge
tensor-parallel parts by Megatron-DeepSpeed's metadata, which our hand-sharded layers lack
(DEEPSPEED_CPU.md: wrong shapes); and the conversion writes a second copy of the whole state to
disk before a run can start. The building blocks used here are the same ones they use.

Precision: master weights and moments are fp32 in every checkpoint; a bf16 run keeps them fp32
(its parameters are bf16 copies of the masters), so fp32 and bf16 runs resume from each other's
checkpoints through this path.
"""

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from metaseq_ds.checkpoint.read import LazyConcat, consolidated_values
from metaseq_ds.checkpoint.safe_loading import safe_load
from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)

MASTER = "fp32"
MOMENTS = ("exp_avg", "exp_avg_sq")
KEYS = (MASTER, *MOMENTS)
# Optimizers whose state is exactly (step, exp_avg, exp_avg_sq) per parameter.
ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)


@dataclass
class SavedOptimizerState:
    """A checkpoint's per-parameter master weights and moments (`values(key)`: name -> a lazily
    read whole tensor, `.contiguous()` reads it; tied names share one) and its step count."""

    read: Callable[[str], Dict[str, Any]]
    step: int
    source: str

    def __post_init__(self):
        self._cache: Dict[str, Dict[str, Any]] = {}

    def values(self, key: str) -> Dict[str, Any]:
        if key not in self._cache:
            self._cache[key] = self.read(key)
        return self._cache[key]


def read_optimizer_state(ref) -> Optional[SavedOptimizerState]:
    """The optimizer state of the checkpoint at `ref` (a `checkpoint.files.CheckpointRef`), or
    None where it holds none (a save of weights alone)."""
    meta = ref.meta()
    if meta.get("consolidated"):
        return SavedOptimizerState(lambda key: consolidated_values(ref, key), meta["optimizer_step"], str(ref.path))
    size = meta.get("tensor_parallel_size", 1)
    stage = meta["zero_stage"]
    if stage == 0:
        parts = [_zero0_part(ref, tp_rank) for tp_rank in range(size)]
        if any(part is None for part in parts):
            return None
        step = parts[0][1]

        def part_values(key, tp_rank):
            return parts[tp_rank][0][key]
    else:
        from metaseq_ds.private_apis.deepspeed_checkpoints import zero_checkpoint_step, zero_checkpoint_values

        step = zero_checkpoint_step(str(ref.path), 0, safe_load)

        def part_values(key, tp_rank):
            return zero_checkpoint_values(str(ref.path), tp_rank, key, safe_load)

    def read(key: str) -> Dict[str, Any]:
        parts = [part_values(key, tp_rank) for tp_rank in range(size)]
        if size == 1:
            return parts[0]
        from metaseq_ds.distributed.tensor_parallel import merge_shards

        return merge_shards(parts, meta["partition_dims"], concat=LazyConcat)

    return SavedOptimizerState(read, step, str(ref.path))


def _zero0_part(ref, tp_rank: int):
    """({key: {name: tensor}}, step) of one tensor-parallel rank of a ZeRO-0 save (memory-mapped),
    or None when its file holds no optimizer state.

    In fp32 the file's "optimizer" is the torch optimizer's state dict and the weights are the
    masters; in fp16/bf16 it is DeepSpeed's unfused optimizer's: the torch state dict under
    "optimizer_state_dict" and one fp32 master per parameter, in the same order, in "fp32_groups"."""
    states = safe_load(ref.path / f"mp_rank_{tp_rank:02d}_model_states.pt", map_location="cpu", mmap=True)
    optimizer = states.get("optimizer") or {}
    copies = [master for group in optimizer.get("fp32_groups", ()) for master in group]
    optimizer = optimizer.get("optimizer_state_dict", optimizer)
    if not optimizer.get("state"):
        return None
    buffers = set(states.get("buffer_names", ()))
    # The optimizer's parameters are the model's, in `named_parameters()` order: the module's
    # state-dict entries that are not buffers, a tied tensor counted once.
    names, seen = {}, {}
    for name, tensor in states["module"].items():
        if name in buffers:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        names[name] = seen.setdefault(key, len(seen))
    indices = [index for group in optimizer["param_groups"] for index in group["params"]]
    state = optimizer["state"]
    first = {}
    for name, position in names.items():
        first.setdefault(position, copies[position] if copies else states["module"][name])
    values = {MASTER: {name: first[position] for name, position in names.items()}}  # a tied weight is one object
    for moment in MOMENTS:
        values[moment] = {name: state[indices[position]][moment] for name, position in names.items()}
    step = int(state[indices[0]]["step"])
    if copies:
        from metaseq_ds.private_apis.deepspeed_optimizers import unfused_optimizer_construction_steps

        step -= unfused_optimizer_construction_steps()  # Adam's steps on real gradients
    return values, step


def restore_optimizer_state(trainer, saved: SavedOptimizerState) -> bool:
    """Set `saved` on the trainer's engine (every rank calls this); False (and a warning) when
    the run's optimizer is not Adam, whose state this carries."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.tensor_parallel import partition_dim
    from metaseq_ds.private_apis.deepspeed_optimizers import (
        link_optimizer_state_fragments,
        unfused_fp32_masters,
        unfused_optimizer_construction_steps,
        zero3_flat_partitions,
    )

    base = trainer.optimizer.optimizer
    if not isinstance(base, ADAM_CLASSES):
        logger.warning(f"--optimizer {trainer.cfg.optimizer._name} ({type(base).__name__}): only Adam's state is "
                       f"carried across layouts; the optimizer state restarts")
        return False
    engine = trainer.engine
    copies = unfused_fp32_masters(engine.optimizer)  # ZeRO-0 in bf16: an fp32 copy per parameter
    # ZeRO-3 hands its flat fp32 partitions to the base optimizer only while it steps.
    stepped = ([master for master, _ in zero3_flat_partitions(engine.optimizer)] if engine.zero_optimization_stage() == 3
               else [param for group in base.param_groups for param in group["params"]])
    # An unbroken run of the unfused optimizer counts its construction step too.
    _create_state(base, stepped, saved.step + (unfused_optimizer_construction_steps() if copies else 0))
    if engine.optimizer is not base:
        link_optimizer_state_fragments(engine.optimizer)
    tp_rank = dist_utils.get_tensor_model_parallel_rank()
    tp_size = dist_utils.get_tensor_model_parallel_world_size()
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        dim = partition_dim(name) if tp_size > 1 else None
        full_shape = list(getattr(param, "ds_shape", param.shape))
        if dim is not None:
            full_shape[dim] *= tp_size
        for key in KEYS:
            whole = _whole_value(saved, key, name, full_shape)
            if whole is None:
                continue
            value = whole if dim is None else whole.chunk(tp_size, dim=dim)[tp_rank].contiguous()
            if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # ZeRO-1/2/3: this rank's partition
                if key == MASTER:
                    safe_set_full_fp32_param(param, value)
                else:
                    safe_set_full_optimizer_state(param, value, key)
                continue
            master = copies.get(id(param), param)
            if key == MASTER:
                master.data.copy_(value)
            else:
                base.state[master][key].copy_(value)
    return True


def _create_state(optimizer: torch.optim.Optimizer, stepped, step: int) -> None:
    """The state torch's Adam creates at its first step (moments of zeros) for each tensor it
    steps (`stepped`), at step `step`."""
    group = optimizer.param_groups[0]  # DeepSpeed keeps one group's options for all
    if group.get("amsgrad"):
        raise UsageError("--amsgrad: its state (max_exp_avg_sq) is not carried across layouts")
    on_device = group.get("fused") or group.get("capturable")
    for param in stepped:
        optimizer.state[param] = {
            "step": torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu"),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
        }


def _whole_value(saved: SavedOptimizerState, key: str, name: str, full_shape) -> Optional[torch.Tensor]:
    """Parameter `name`'s whole saved `key` value in fp32 for a model whose parameter is `full_shape`.

    A larger tensor-parallel degree pads the vocabulary further: the new padding rows' master
    weights keep the values materialisation gave them (None: nothing to set) and their moments
    start at zero, as for rows no update has touched."""
    from metaseq_ds.distributed.tensor_parallel import is_vocabulary_parameter

    saved_value = saved.values(key).get(name)
    if saved_value is None:
        raise UsageError(f"{saved.source}: no saved {key} for parameter {name!r} (a checkpoint of another model?)")
    saved_shape, full_shape = tuple(saved_value.shape), tuple(full_shape)
    if saved_shape == full_shape:
        return saved_value.contiguous().float()
    if is_vocabulary_parameter(name) and saved_shape[1:] == full_shape[1:] and saved_shape[0] < full_shape[0]:
        if key == MASTER:
            return None
        grown = torch.zeros(full_shape)
        grown[: saved_shape[0]] = saved_value.contiguous().float()
        return grown
    raise UsageError(f"{saved.source}: {key} of {name} has shape {saved_shape}, this model {full_shape}")
