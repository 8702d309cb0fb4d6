"""What a checkpoint of any layout holds, read lazily: the model's weights and the trainer's state.

    weights = lazy_model_weights(ref)     # name -> a tensor read by `.contiguous()`, tied names one object
    state = saved_client_state(ref, Layout.of_checkpoint(meta), meta)   # updates, LR schedule, meters, data position, task state

ZeRO shards are consolidated through DeepSpeed's zero_to_fp32 workers
(`private_apis.deepspeed_checkpoints`), tensor-parallel parts joined on our partition dimensions
(`LazyConcat`), and a consolidated checkpoint (`checkpoint.reshard`) read from its safetensors files.
"""

from typing import Any, Dict

import torch

from metaseq_ds.checkpoint.files import CLIENT_STATE, CheckpointRef, consolidated_file
from metaseq_ds.checkpoint.layout import Layout
from metaseq_ds.checkpoint.safe_loading import safe_load
from metaseq_ds.checkpoint.safetensors_io import read_weight_file


def load_model_weights(ref: CheckpointRef) -> Dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint, gathered from ZeRO and tensor-parallel shards (one process)."""
    weights = lazy_model_weights(ref)
    converted: Dict[int, torch.Tensor] = {}  # by identity: a tied weight stays one tensor
    return {name: converted.setdefault(id(value), value.contiguous().float()) for name, value in weights.items()}


def lazy_model_weights(ref: CheckpointRef) -> Dict[str, Any]:
    """The full weights, each materialised only by `.contiguous()`.

    Files are memory-mapped (ZeRO shards through DeepSpeed's lazy mode), so a caller that
    converts one tensor at a time never holds two copies of the model. Tied weights are the
    same object under both names. Values keep their saved dtype (a bf16 run's module is bf16,
    ZeRO's master weights are fp32). A tensor-parallel save is merged by its partition
    metadata: each sharded tensor is the concatenation of its ranks' shards. A consolidated
    checkpoint (`mseq reshard`) holds whole tensors already.
    """
    meta = ref.meta()
    if meta.get("consolidated"):  # `mseq reshard` output: whole fp32 master weights
        return consolidated_values(ref, "fp32")
    size = meta.get("tensor_parallel_size", 1)
    parts = [_tensor_parallel_part(ref, meta["zero_stage"], tp_rank) for tp_rank in range(size)]
    if size == 1:
        return parts[0]
    from metaseq_ds.distributed.tensor_parallel import merge_shards

    return merge_shards(parts, meta["partition_dims"], concat=LazyConcat)


def _tensor_parallel_part(ref: CheckpointRef, zero_stage: int, tp_rank: int) -> Dict[str, Any]:
    """One tensor-parallel rank's weights, consolidated over its data-parallel ZeRO shards."""
    if zero_stage == 0:
        states = safe_load(ref.path / f"mp_rank_{tp_rank:02d}_model_states.pt", map_location="cpu", mmap=True)
        return dict(states["module"])
    from metaseq_ds.private_apis.deepspeed_checkpoints import consolidate_zero_shards

    return consolidate_zero_shards(str(ref.path), tp_rank)


class LazyConcat:
    """A merged tensor-parallel tensor that reads its shards only when `.contiguous()` is called
    (`parts`, one per tensor-parallel rank, joined on `dim`)."""

    def __init__(self, parts, dim: int):
        self.parts, self.dim = parts, dim
        shapes = [tuple(part.shape) for part in parts]
        self.shape = torch.Size(
            sum(shape[d] for shape in shapes) if d == dim else size for d, size in enumerate(shapes[0]))

    def contiguous(self) -> torch.Tensor:
        return torch.cat([part.contiguous() for part in self.parts], dim=self.dim)


def consolidated_values(ref: CheckpointRef, key: str) -> Dict[str, Any]:
    """One file of a consolidated checkpoint: name -> lazily read tensor, tied names included."""
    values = read_weight_file(consolidated_file(ref, key))
    for alias, name in ref.meta()["tied"].items():
        values[alias] = values[name]
    return values


def saved_client_state(ref: CheckpointRef, saved: Layout, meta: Dict[str, Any]) -> Dict[str, Any]:
    """The trainer state and data position a save holds (rank 0's copy: every rank saved the same)."""
    if meta.get("consolidated"):
        return safe_load(ref.path / CLIENT_STATE, map_location="cpu")
    states_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if saved.zero_stage == 3 else "mp_rank_00_model_states.pt"
    states = safe_load(ref.path / states_file, map_location="cpu", mmap=True)
    client_state = {key: states[key] for key in ("num_updates", "lr_scheduler", "metrics", "rng", "iterator")}
    if "task_state" in states:  # absent from checkpoints saved before tasks kept state
        client_state["task_state"] = states["task_state"]
    return client_state
