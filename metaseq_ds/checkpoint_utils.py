"""Checkpoints of `mseq train`: one DeepSpeed tag per save, with a readable meta file.

Layout of `--save-dir`:
    checkpoint_<epoch>_<updates>/     DeepSpeed's files (ZeRO shards per rank) + our client state
    checkpoint_<epoch>_<updates>/metaseq_ds.json   arch, config, updates, world size (human-readable)
    checkpoint_last                   the tag of the newest complete save (one line)

`checkpoint_last` is replaced atomically only after every rank has finished writing, so a
crash during a save leaves the previous checkpoint as the one that resumes.
"""

import ctypes
import functools
import json
import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)

LAST = "checkpoint_last"
META = "metaseq_ds.json"


@dataclass
class CheckpointRef:
    save_dir: Path
    tag: str

    @property
    def path(self) -> Path:
        return self.save_dir / self.tag

    def meta(self) -> Dict[str, Any]:
        meta_file = self.path / META
        try:
            return json.loads(meta_file.read_text())
        except (OSError, ValueError) as error:
            raise UsageError(f"{self.path}: not a metaseq_ds checkpoint (cannot read {META}: {error})") from None


def tag_for(epoch: int, num_updates: int) -> str:
    return f"checkpoint_{epoch}_{num_updates}"


def find_checkpoint(path: str, save_dir: Optional[str] = None) -> Optional[CheckpointRef]:
    """Resolve `--restore-file`/`--path`: a tag in save_dir, a tag dir, or a save dir (its last tag)."""
    candidates = []
    if save_dir is not None:
        candidates.append(Path(save_dir) / path)
    candidates.append(Path(path))
    for candidate in candidates:
        if candidate.name == LAST and candidate.is_file():
            return CheckpointRef(candidate.parent, candidate.read_text().strip())
        if (candidate / META).is_file():
            return CheckpointRef(candidate.parent, candidate.name)
        if (candidate / LAST).is_file():
            return CheckpointRef(candidate, (candidate / LAST).read_text().strip())
    return None


def write_meta(ref: CheckpointRef, meta: Dict[str, Any]) -> None:
    _atomic_write(ref.path / META, json.dumps(meta, indent=2, sort_keys=True))


def mark_last(ref: CheckpointRef) -> None:
    _atomic_write(ref.save_dir / LAST, ref.tag + "\n")


def write_module_checkpoint(save_dir: Path, tag: str, module_state: Dict[str, torch.Tensor], meta: Dict[str, Any]) -> CheckpointRef:
    """A checkpoint of weights alone, in the layout of a one-rank ZeRO-0 save, marked last.

    Imports write these (and tests and benchmarks stand in for `mseq train` with them);
    readers cannot tell them from a save by the trainer, except by what `meta` says.
    """
    ref = CheckpointRef(Path(save_dir), tag)
    ref.path.mkdir(parents=True)
    torch.save({"module": module_state}, ref.path / "mp_rank_00_model_states.pt")
    write_meta(ref, {"num_updates": 0, "epoch": 1, "world_size": 1, "zero_stage": 0, **meta})
    mark_last(ref)
    return ref


def remove_old_checkpoints(save_dir: Path, keep_last: int, current: str) -> None:
    """Keep the newest `keep_last` update checkpoints (by update count); never the current one."""
    if keep_last < 0:
        return
    tags = sorted(
        (p for p in save_dir.glob("checkpoint_*_*") if (p / META).is_file()),
        key=lambda p: int(p.name.rsplit("_", 1)[1]),
    )
    for old in tags[: max(0, len(tags) - keep_last)]:
        if old.name != current:
            shutil.rmtree(old, ignore_errors=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def check_compatible(meta: Dict[str, Any], arch: str, model_cfg: Dict[str, Any], where: Path) -> None:
    """A save dir holding another model is a user mistake: say so before anything is built."""
    saved_arch = meta["config"].get("arch")
    saved_model = {k: v for k, v in meta["config"]["model"].items() if k not in ("dropout", "attention_dropout", "activation_dropout")}
    ours = {k: v for k, v in model_cfg.items() if k not in ("dropout", "attention_dropout", "activation_dropout")}
    if saved_arch != arch or saved_model != ours:
        differing = sorted(k for k in set(saved_model) | set(ours) if saved_model.get(k) != ours.get(k))
        detail = f"--arch {saved_arch}" if saved_arch != arch else ", ".join(
            f"{k}={saved_model.get(k)!r} (now {ours.get(k)!r})" for k in differing[:3]
        )
        raise UsageError(
            f"{where} holds a checkpoint of another model ({detail}); "
            f"use another --save-dir, or the same architecture to resume"
        )


def tensor_parallel_meta(module: torch.nn.Module, size: int) -> Dict[str, Any]:
    """What merging a tensor-parallel save needs: the degree and each sharded tensor's split dimension."""
    if size <= 1:
        return {}
    from metaseq_ds.distributed.tensor_parallel import partition_dims

    names = [name for name, _ in module.named_parameters(remove_duplicate=False)]
    return {"tensor_parallel_size": size, "partition_dims": partition_dims(names)}


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
        from metaseq_ds.reshard import consolidated_values

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
        from metaseq_ds.distributed.safe_checkpoint_loading import safe_load

        states = safe_load(ref.path / f"mp_rank_{tp_rank:02d}_model_states.pt", map_location="cpu", mmap=True)
        return dict(states["module"])
    from metaseq_ds.private_apis import consolidate_zero_shards

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


class CheckpointValues:
    """A checkpoint's weights as parameter values for `distributed.materialize`, read tensor by
    tensor (`weights` maps each name to a lazily read tensor: `lazy_model_weights`, or the lazy
    safetensors of `convert.hf_import`), each rank taking only its part.

    A tensor-parallel save read at its own degree gives each rank its saved part directly. Saved
    vocabulary rows fewer than the model's (a larger tensor-parallel degree pads the vocabulary
    to a multiple of 8*N) are kept, and the new padding rows take their initial values.
    """

    def __init__(self, weights: Dict[str, Any], source: str, initial):
        self.weights, self.source, self.initial = weights, source, initial

    def shard(self, name: str, full_shape, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        saved = self.weights.get(name)
        if saved is None:
            raise UsageError(f"{self.source}: weight {name!r} is missing (a checkpoint of another model?)")
        value = self._part_of(saved, name, tuple(full_shape), dim, rank, size)
        # The part must not live in the checkpoint's file mapping (a parameter would keep those
        # pages in memory), and the pages read to make it are let go at once: only the rank's
        # parts accumulate, whatever the saved layout (a row-parallel slice reads every page).
        if file_mapped(value):
            value = value.clone()
        for tensor in saved.parts if isinstance(saved, LazyConcat) else [saved]:
            release_file_pages(tensor)
        return value

    def _part_of(self, saved, name: str, full_shape, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        from metaseq_ds.distributed.tensor_parallel import is_vocabulary_parameter

        saved_shape = tuple(saved.shape)
        if saved_shape == full_shape:
            if isinstance(saved, LazyConcat) and dim == saved.dim and len(saved.parts) == size:
                return saved.parts[rank].contiguous().float()  # saved at this tensor-parallel degree
            return _part(saved.contiguous().float(), dim, rank, size)
        if is_vocabulary_parameter(name) and saved_shape[1:] == full_shape[1:] and saved_shape[0] < full_shape[0]:
            grown = self.initial.whole(name, full_shape)
            grown[: saved_shape[0]] = saved.contiguous().float()
            logger.warning(f"{name}: {saved_shape[0]} saved vocabulary rows, {full_shape[0]} now; "
                           f"the {full_shape[0] - saved_shape[0]} new padding rows keep their initial values")
            return _part(grown, dim, rank, size)
        raise UsageError(f"{self.source}: weight {name} has shape {saved_shape}, this model {full_shape}")

    def check_all_used(self, parameter_names) -> None:
        unused = sorted(set(self.weights) - set(parameter_names))
        if unused:
            raise UsageError(f"{self.source}: weight {unused[0]!r} has no place in this model")


def file_mapped(tensor: Any) -> bool:
    """Whether `tensor`'s memory is a memory-mapped file's (`torch.load(mmap=True)`): torch does
    not say (`UntypedStorage.filename` is None for those), the process's memory map does."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return False
    address = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                if start <= address < end:
                    return len(fields) == 6 and fields[5].startswith("/")  # a path, not [heap] or anonymous
    except OSError:  # no /proc (not Linux): parts may stay in the mapping, nothing is released
        pass
    return False


def release_file_pages(tensor: Any) -> None:
    """Drop the pages of a file-mapped, never written `tensor` from this process's memory
    (madvise MADV_DONTNEED; they are read from the file again if touched). Other tensors are
    left alone: on anonymous memory that call would zero them."""
    if not file_mapped(tensor):
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


MADV_DONTNEED = 4  # Linux


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _part(value: torch.Tensor, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
    return value if dim is None or size == 1 else value.chunk(size, dim=dim)[rank].contiguous()


def load_model_for_inference(path: str, data: Optional[str] = None, need_data: bool = True):
    """(cfg, task, model in eval mode, ref) of the checkpoint at `path` (`--path` of validate and
    generate), in fp32 on the accelerator (the CPU here); `data` overrides the run's data directory.

    The model is built on the meta device and filled tensor by tensor from the checkpoint's
    memory-mapped files (`distributed.materialize`), so no second copy of the weights is ever
    held. Under a launcher whose ranks form a tensor-parallel group, each rank builds its shard
    by the plan and reads only its part of each weight.
    With `need_data=False` (generation) the run's data directory need not exist any more.
    """
    from metaseq_ds import tasks
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.distributed.tensor_parallel import check_divisible
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import config_from_dict

    ref = find_checkpoint(path)
    if ref is None:
        raise UsageError(f"--path: {path} is not a checkpoint (expected a save dir with checkpoint_last, or a checkpoint_* dir)")
    saved = ref.meta()["config"]
    if data is None and need_data and not saved["task"].get("data", True):
        raise UsageError(f"--path {path}: the checkpoint records no data directory (imported weights?): give --data DATA")
    # Without data (generation) the task opens no data directory: a moved corpus is no obstacle.
    overrides = {"task": {"data": data}} if data is not None or not need_data else {}
    cfg = config_from_dict(saved, overrides)
    tp_size = dist_utils.get_tensor_model_parallel_world_size()
    check_divisible(cfg.model, tp_size, source="the number of ranks,")
    task = tasks.setup_task(cfg.task)

    def saved_values(model):
        initial = InitialValues(model, model.init_seed) if model.init_seed is not None else None
        return CheckpointValues(lazy_model_weights(ref), str(ref.path), initial)

    model = build_model(cfg, task, None, saved_values, zero3_config=None)
    model.eval()
    return cfg, task, model, ref
