"""One owner of `mseq train`'s checkpoints: what a run resumes from, restoring it, saving.

    manager = CheckpointManager(cfg, layout)      # this run's ranks, ZeRO stage, tensor-parallel degree
    plan = manager.plan()                          # before the model exists: what we resume from, checked
    cfg = manager.resolve_config(plan)             # with what the checkpoint settles (options.resolve)
    model = build_model(cfg, task, criterion,       # distributed.materialize: each rank only its part
                        lambda model: manager.parameter_values(plan, model), zero3_config)
    ... Trainer (the DeepSpeed engine) ...
    manager.restore(plan, trainer, epoch_itr)      # engine state, trainer state, data position
    manager.save(trainer, epoch_itr)               # `checkpoint_last` moves only once every rank wrote

A `ResumePlan` is one of:
- FRESH: nothing to resume (no checkpoint in --save-dir, or --no-save): the flags' initialisation;
- EXACT: a checkpoint of this run's layout: DeepSpeed reloads its own state, optimizer included;
- RESHARD: a checkpoint of another layout (rank count, ZeRO stage, tensor-parallel degree,
  precision), or a consolidated one (`mseq reshard`): the weights, the fp32 master weights, Adam's
  moments and step (`checkpoint.optimizer_state`), the update count, LR schedule, meters and the data
  position, so the next updates are those of an unbroken run on the new layout;
- WEIGHTS: weights without training state (`mseq import` output, or `--restore-file FORMAT:DIR`
  for a format the caller hands in, `hf:DIR` under `mseq train`): update 0, fresh optimizer and
  data order.

The files themselves are `checkpoint.files`' (layout, meta file) and `checkpoint.read`'s
(consolidation of shards); the trainer's own state is `Trainer.state_dict()`.
"""

import enum
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from metaseq_ds.checkpoint import files
from metaseq_ds.checkpoint.layout import Layout
from metaseq_ds.checkpoint.optimizer_state import read_optimizer_state, restore_optimizer_state
from metaseq_ds.checkpoint.read import lazy_model_weights, saved_client_state
from metaseq_ds.checkpoint.values import CheckpointValues
from metaseq_ds.errors import UsageError
from metaseq_ds.options import RunContext, flag, resolve

logger = logging.getLogger(__name__)

DEFAULT_RESTORE_FILE = files.LAST
# Reads a folder of another format: (our model fields, our state dict of lazily read tensors).
ForeignReader = Callable[[Path], Tuple[Dict[str, Any], Dict[str, Any]]]
# Model fields that may differ between a checkpoint and the run that starts from it.
TRAINING_ONLY_MODEL_FIELDS = ("dropout", "attention_dropout", "activation_dropout", "init_std")


class ResumeKind(enum.Enum):
    FRESH = "fresh"
    EXACT = "exact"
    RESHARD = "reshard"
    WEIGHTS = "weights"


@dataclass(frozen=True)
class ResumePlan:
    """What a run starts from (see the module docstring), decided before anything is built."""

    kind: ResumeKind
    source: str = ""
    ref: Optional[files.CheckpointRef] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    # WEIGHTS and RESHARD: the weights, each read (lazily) when the model's parameters are made.
    read_weights: Optional[Callable[[], Dict[str, Any]]] = None
    # RESHARD: the saved trainer state and data position (DeepSpeed's "client state"), and the
    # global micro-batch the data position counts in.
    client_state: Optional[Dict[str, Any]] = None
    saved_layout: Optional[Layout] = None
    saved_global_batch: Optional[int] = None

    def run_context(self) -> RunContext:
        task = self.meta.get("config", {}).get("task", {})
        return RunContext(restored_padding_factor=task.get("padding_factor"))


class CheckpointManager:
    """`foreign_formats`: the readers of `--restore-file NAME:DIR` by NAME (`mseq train` hands in
    `{"hf": convert.hf_import.read_hf_model}`: conversion depends on checkpoints, not the reverse)."""

    def __init__(self, cfg, layout: Layout, foreign_formats: Mapping[str, ForeignReader] = {}):
        self.cfg = cfg
        self.layout = layout
        self.foreign_formats = dict(foreign_formats)
        self.save_dir = Path(cfg.checkpoint.save_dir)
        self.saved_update: Optional[int] = None  # the update of the last save (or resume) of this run

    # -- what to resume from ---------------------------------------------------------------------

    def plan(self) -> ResumePlan:
        """What this run resumes from, checked against its flags before any model is built."""
        ckpt = self.cfg.checkpoint
        format_name, _, folder = ckpt.restore_file.partition(":")
        if folder and format_name in self.foreign_formats:
            return self._foreign_plan(format_name, Path(folder))
        if ckpt.no_save and ckpt.restore_file == DEFAULT_RESTORE_FILE:
            return ResumePlan(ResumeKind.FRESH)  # a --no-save run never reads --save-dir's state
        ref = files.find_checkpoint(ckpt.restore_file, ckpt.save_dir)
        if ref is None:
            if ckpt.restore_file != DEFAULT_RESTORE_FILE:
                raise UsageError(f"--restore-file: no checkpoint at {ckpt.restore_file}")
            return ResumePlan(ResumeKind.FRESH)
        meta = ref.meta()
        # An imported checkpoint names no --arch of ours (its sizes are explicit): compare the model only.
        arch = meta["config"].get("arch") if meta.get("weights_only") else self.cfg.arch
        files.check_compatible(meta, arch, self.cfg.to_dict()["model"], ref.save_dir)
        read = _reader(ref)
        if meta.get("weights_only"):
            return ResumePlan(ResumeKind.WEIGHTS, str(ref.path), ref, meta, read_weights=read)
        saved = Layout.of_checkpoint(meta)
        if saved.same_state_as(self.layout) and not meta.get("consolidated"):
            return ResumePlan(ResumeKind.EXACT, str(ref.path), ref, meta)
        plan = ResumePlan(
            ResumeKind.RESHARD, str(ref.path), ref, meta, read_weights=read,
            client_state=saved_client_state(ref, saved, meta), saved_layout=saved,
            saved_global_batch=meta["config"]["dataset"]["batch_size"] * saved.data_parallel_size,
        )
        if not ckpt.reset_dataloader:
            self._data_position(plan)  # a position this layout cannot continue from stops here
        return plan

    def _foreign_plan(self, format_name: str, folder: Path) -> ResumePlan:
        """`--restore-file hf:DIR` (or another registered format): the folder's weights, checked
        against this run's model flags."""
        fields, state_dict = self.foreign_formats[format_name](folder)
        for name, value in fields.items():
            ours = getattr(self.cfg.model, name)
            if name in TRAINING_ONLY_MODEL_FIELDS or ours == value:
                continue
            if isinstance(value, bool):
                hint = flag(name) if value else f"no {flag(name)}"
            else:
                hint = f"{flag(name)} {value}" if value is not None else f"no {flag(name)}"
            raise UsageError(f"--restore-file {format_name}:{folder}: the model has {name}={value!r}, this run {ours!r} (use {hint})")
        return ResumePlan(ResumeKind.WEIGHTS, f"{format_name}:{folder}", read_weights=lambda: state_dict)

    def resolve_config(self, plan: ResumePlan):
        """The run's config with what the plan's checkpoint settles (`options.resolve`): the
        config the run uses, and the one its saves record."""
        self.cfg = resolve(self.cfg, plan.run_context())
        return self.cfg

    # -- restoring -------------------------------------------------------------------------------

    def parameter_values(self, plan: ResumePlan, model: torch.nn.Module):
        """Where the model's parameters get their values (`distributed.materialize`): the saved
        weights (WEIGHTS, RESHARD: read tensor by tensor, each rank only its part), else the
        model's initial values (FRESH, EXACT: DeepSpeed then loads its own state). None for a
        model built whole with nothing to load (its constructor initialised it)."""
        from metaseq_ds.models.initialization import InitialValues

        initial = InitialValues(model, model.init_seed) if model.init_seed is not None else None
        if plan.read_weights is None:
            return initial
        return CheckpointValues(plan.read_weights(), f"--restore-file {plan.source}", initial)

    def restore(self, plan: ResumePlan, trainer, epoch_itr) -> None:
        """The training state the plan carries, into the engine, the trainer and the data iterator."""
        from metaseq_ds.distributed import utils as dist_utils

        ckpt = self.cfg.checkpoint
        if plan.kind is ResumeKind.FRESH:
            return
        if plan.kind is ResumeKind.WEIGHTS:
            logger.info(f"started from the weights of {plan.source} (update 0, fresh optimizer and data order)")
            return
        if plan.kind is ResumeKind.EXACT:
            load_optimizer = not ckpt.reset_optimizer
            _, client_state = trainer.engine.load_checkpoint(
                str(plan.ref.save_dir), tag=plan.ref.tag, load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False, load_module_only=not load_optimizer,
            )
            trainer.load_state_dict(client_state)
            if not ckpt.reset_dataloader:
                epoch_itr.load_state_dict(client_state["iterator"])
            dist_utils.barrier()
            logger.info(f"resumed from {plan.ref.path} at update {trainer.num_updates}")
        else:
            self._restore_resharded(plan, trainer, epoch_itr)
        self.saved_update = trainer.num_updates

    def _data_position(self, plan: ResumePlan) -> Dict[str, int]:
        """The saved data position in this run's micro-batches.

        The sample stream of an epoch does not depend on the layout (`data.iterators`): a position
        is a number of samples read, so any split of the global micro-batch continues at the same
        sample. A count of samples this run's global micro-batch does not divide is refused."""
        saved = plan.client_state["iterator"]
        samples = saved["iterations_in_epoch"] * plan.saved_global_batch
        global_batch = self.cfg.dataset.batch_size * self.layout.data_parallel_size
        if samples % global_batch:
            raise UsageError(
                f"--batch-size {self.cfg.dataset.batch_size} x {self.layout.data_parallel_size} data-parallel rank(s) = "
                f"{global_batch} samples per micro-batch does not divide the {samples} samples {plan.source} has read "
                f"of epoch {saved['epoch']} (it ran {plan.saved_global_batch} per micro-batch): keep --batch-size x "
                f"data-parallel ranks a divisor of {samples}, or give --reset-dataloader")
        return {"epoch": saved["epoch"], "iterations_in_epoch": samples // global_batch}

    def _restore_resharded(self, plan: ResumePlan, trainer, epoch_itr) -> None:
        trainer.load_state_dict(plan.client_state)
        if not self.cfg.checkpoint.reset_dataloader:
            epoch_itr.load_state_dict(self._data_position(plan))
        carried = "weights"
        if self.cfg.checkpoint.reset_optimizer:
            carried += " (--reset-optimizer: Adam restarts)"
        else:
            saved = read_optimizer_state(plan.ref)
            if saved is None:
                carried += " (the save holds no optimizer state: Adam restarts)"
            elif restore_optimizer_state(trainer, saved):
                carried += f", fp32 master weights, Adam moments and step {saved.step}"
        logger.warning(f"resharded {plan.source} (saved by {plan.saved_layout}, now {self.layout}): {carried}, "
                       f"update {trainer.num_updates}, LR schedule, meters and data position restored")

    # -- saving ----------------------------------------------------------------------------------

    def save(self, trainer, epoch_itr) -> None:
        """A checkpoint of every rank's state; `checkpoint_last` points at it once all ranks wrote."""
        from metaseq_ds.distributed import utils as dist_utils

        if self.cfg.checkpoint.no_save:
            return
        self.save_dir.mkdir(parents=True, exist_ok=True)
        ref = files.CheckpointRef(self.save_dir, files.tag_for(epoch_itr.epoch, trainer.num_updates))
        client_state = {**trainer.state_dict(), "iterator": epoch_itr.state_dict()}
        trainer.engine.save_checkpoint(str(self.save_dir), tag=ref.tag, client_state=client_state, save_latest=False)
        dist_utils.barrier()  # every rank's shards are on disk before the save counts
        if dist_utils.is_master():
            files.write_meta(ref, {
                "config": self.cfg.to_dict(), "num_updates": trainer.num_updates, "epoch": epoch_itr.epoch,
                "world_size": self.layout.world_size, "zero_stage": trainer.zero_stage, "precision": self.layout.precision,
                "optimizer_group_limit": self.layout.optimizer_group_limit,
                **files.tensor_parallel_meta(trainer.engine.module, self.layout.tensor_parallel_size),
            })
            files.mark_last(ref)
            files.remove_old_checkpoints(self.save_dir, self.cfg.checkpoint.keep_last_updates, ref.tag)
            logger.info(f"saved checkpoint {ref.path} (update {trainer.num_updates})")
        dist_utils.barrier()
        self.saved_update = trainer.num_updates

    def save_at_end(self, trainer, epoch_itr) -> None:
        """The final save, unless this update is saved already in --save-dir."""
        if self.saved_update == trainer.num_updates and (self.save_dir / files.LAST).is_file():
            return
        self.save(trainer, epoch_itr)


def _reader(ref: files.CheckpointRef) -> Callable[[], Dict[str, Any]]:
    return lambda: lazy_model_weights(ref)
