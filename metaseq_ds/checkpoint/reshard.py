"""`mseq reshard CKPT OUT --ranks N --tensor-parallel-size T [--zero-stage S]`: a training
checkpoint of any layout, consolidated for a run on another, before the job starts.

    reshard("runs/a", "runs/a-1gpu", ranks=1, tensor_parallel_size=1)
    mseq train ... --restore-file runs/a-1gpu       # or --save-dir runs/a-1gpu

OUT holds one layout-free checkpoint, read by `mseq train` (`checkpoint.optimizer_state`), `validate`,
`generate` and `export` like any other:

    OUT/checkpoint_<epoch>_<updates>/fp32.safetensors         every parameter's fp32 master weight, whole
    OUT/checkpoint_<epoch>_<updates>/exp_avg.safetensors      Adam's first moment, same names
    OUT/checkpoint_<epoch>_<updates>/exp_avg_sq.safetensors   Adam's second moment
    OUT/checkpoint_<epoch>_<updates>/client_state.pt          update count, LR schedule, meters, data position
    OUT/checkpoint_<epoch>_<updates>/metaseq_ds.json          the saving run's meta (config, layout), and
                                                              "consolidated": true, Adam's step, tied names,
                                                              the target layout
    OUT/checkpoint_last

Why not the files DeepSpeed would write for the target layout: those are each stage's private
flattening (group order, alignment padding, partition boundaries), and a resumed run re-derives
its own from whole parameters anyway. Whole per-parameter tensors are what every rank of any
layout reads its part from (memory-mapped, one parameter at a time), so the target layout given
here is checked (heads and FFN divide T, T divides N) and recorded, not baked into the files.

Memory: the source is memory-mapped and each value is produced, written and dropped in turn
(`checkpoint.safetensors_io`); OUT appears only once complete (`checkpoint.staged_output`).
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Dict, Optional

from pydantic import Field

from metaseq_ds.dataclass.constraints import PositiveInt
from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TargetLayout:
    """The layout `mseq reshard` prepares a checkpoint for, each number's range declared once
    (the check before any work, `--help` and the one-line error read it)."""

    ranks: PositiveInt
    tensor_parallel_size: PositiveInt = 1
    zero_stage: Optional[Annotated[int, Field(ge=0, le=3)]] = None  # None: the checkpoint's

    def validate(self) -> None:
        from metaseq_ds.dataclass import validate_value

        for name in ("ranks", "tensor_parallel_size", "zero_stage"):
            if getattr(self, name) is not None:
                validate_value(TargetLayout, name, getattr(self, name), "--" + name.replace("_", "-"))
        if self.ranks % self.tensor_parallel_size:
            raise UsageError(f"--tensor-parallel-size {self.tensor_parallel_size} does not divide --ranks {self.ranks} "
                             f"(the ranks form data-parallel x tensor-parallel groups)")


def reshard(checkpoint: str, out: str, ranks: int, tensor_parallel_size: int, zero_stage: Optional[int] = None) -> Path:
    """Write the consolidated checkpoint of `checkpoint` for the given layout into `out`; its path."""
    TargetLayout(ranks, tensor_parallel_size, zero_stage).validate()  # before anything is read
    import torch

    from metaseq_ds.checkpoint import files
    from metaseq_ds.checkpoint.layout import Layout
    from metaseq_ds.checkpoint.optimizer_state import KEYS, read_optimizer_state
    from metaseq_ds.checkpoint.read import saved_client_state
    from metaseq_ds.checkpoint.safetensors_io import PendingTensor, write_file
    from metaseq_ds.checkpoint.staged_output import check_free, staged_output
    from metaseq_ds.distributed.tensor_parallel import check_divisible
    from metaseq_ds.options import config_from_dict

    ref = files.find_checkpoint(checkpoint)
    if ref is None:
        raise UsageError(f"CKPT {checkpoint} is not a checkpoint (expected a save dir with checkpoint_last, or a checkpoint_* dir)")
    meta = ref.meta()
    if meta.get("weights_only"):
        raise UsageError(f"CKPT {ref.path} holds weights only (an import): there is no training state to reshard; "
                         f"give it to mseq train --restore-file as it is")
    saved = Layout.of_checkpoint(meta)
    stage = saved.zero_stage if zero_stage is None else zero_stage
    target = Layout(ranks, stage, tensor_parallel_size, saved.precision)
    check_divisible(config_from_dict(meta["config"]).model, tensor_parallel_size, source="--tensor-parallel-size")
    check_free(Path(out))
    state = read_optimizer_state(ref)
    if state is None:
        raise UsageError(f"CKPT {ref.path} holds no optimizer state (a save of weights alone): give it to "
                         f"mseq train --restore-file as it is")
    client_state = saved_client_state(ref, saved, meta)

    names, tied = _unique_names(state.values("exp_avg"))  # parameters only, as the optimizer holds them
    with staged_output(Path(out)) as staging:
        target_ref = files.CheckpointRef(staging, ref.tag)
        target_ref.path.mkdir()
        for key in KEYS:
            values = state.values(key)
            pending = [PendingTensor(name, tuple(values[name].shape), torch.float32,
                                     lambda value=values[name]: value.contiguous().float()) for name in names]
            write_file(files.consolidated_file(target_ref, key), pending, {"format": "pt"})
        torch.save(client_state, target_ref.path / files.CLIENT_STATE)
        # The layout fields stay the saving run's ("saved by", and the unit of its data position).
        files.write_meta(target_ref, {
            **meta, "consolidated": True, "optimizer_step": state.step, "tied": tied, "resharded_from": str(ref.path),
            "target_layout": {"world_size": target.world_size, "zero_stage": target.zero_stage,
                              "tensor_parallel_size": target.tensor_parallel_size},
        })
        files.mark_last(target_ref)
    logger.info(f"resharded {ref.path} (saved by {saved}) for {target}: {len(names)} parameters, Adam step {state.step}")
    return Path(out) / ref.tag


def _unique_names(values: Dict[str, Any]):
    """(names to write, {tied name: the name written}): tied parameters are one object."""
    first: Dict[int, str] = {}
    names, tied = [], {}
    for name, value in values.items():
        if id(value) in first:
            tied[name] = first[id(value)]
        else:
            first[id(value)] = name
            names.append(name)
    return names, tied
