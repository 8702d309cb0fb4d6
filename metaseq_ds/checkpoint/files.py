"""The files of a save dir: where each thing lies, the meta file, the `checkpoint_last` marker.

Layout of `--save-dir`:
    checkpoint_<epoch>_<updates>/     DeepSpeed's files (ZeRO shards per rank) + our client state
    checkpoint_<epoch>_<updates>/metaseq_ds.json   arch, config, updates, world size (human-readable)
    checkpoint_last                   the tag of the newest complete save (one line)

A consolidated checkpoint (`mseq reshard`, `checkpoint.reshard`) holds instead, in its tag dir,
`<key>.safetensors` for each of fp32, exp_avg, exp_avg_sq (`consolidated_file`) and
`client_state.pt` (`CLIENT_STATE`).

`checkpoint_last` is replaced atomically only after every rank has finished writing, so a
crash during a save leaves the previous checkpoint as the one that resumes.
"""

import json
import logging
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
CLIENT_STATE = "client_state.pt"  # a consolidated checkpoint's trainer state and data position


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


def consolidated_file(ref: CheckpointRef, key: str) -> Path:
    """A consolidated checkpoint's file of `key` (fp32, exp_avg, exp_avg_sq): every parameter, whole."""
    return ref.path / f"{key}.safetensors"


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
