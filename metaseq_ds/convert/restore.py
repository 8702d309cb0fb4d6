"""Starting `mseq train` from weights rather than resuming: imports, `hf:DIR`, and resharding.

`mseq train --restore-file X` resumes exactly (DeepSpeed's own load) when X was saved by
the same number of ranks with the same ZeRO stage and tensor-parallel degree. Otherwise the
weights are merged and loaded into the plain model before it is sharded, so any ZeRO stage,
rank count and tensor-parallel degree can take them:
- an imported checkpoint (`"weights_only"` in its meta) or `hf:DIR`: update 0, fresh optimizer;
- a checkpoint of another world size, ZeRO stage or tensor-parallel degree: the consolidated
  weights, plus update count, LR schedule, meters and (if the global micro-batch is unchanged)
  the data position. Optimizer state is NOT carried over (Adam moments restart; a warning
  says so): resharding it needs DeepSpeed's universal checkpoints, not wired up yet.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from metaseq_ds.distributed.tensor_parallel import tensor_parallel_size
from metaseq_ds.errors import UsageError

logger = logging.getLogger("metaseq_ds.cli.train")

HF_PREFIX = "hf:"
_IGNORED_FIELDS = ("dropout", "attention_dropout", "activation_dropout", "init_std")


@dataclass
class WeightsRestore:
    source: str
    load_weights: Callable[[], Dict[str, torch.Tensor]]
    client_state: Optional[Dict[str, Any]] = None
    saved_global_batch: Optional[int] = None
    reason: str = ""

    def load_into(self, model: torch.nn.Module) -> None:
        """Call before the model is sharded: the TP plan and ZeRO then partition these values."""
        weights = self.load_weights()
        try:
            model.load_state_dict(_fit_vocabulary_rows(weights, model.state_dict()))
        except RuntimeError as error:
            detail = " ".join(str(error).split())[:300]
            raise UsageError(f"--restore-file {self.source}: its weights do not fit this model ({detail})") from None

    def after_trainer(self, cfg, trainer, epoch_itr, data_parallel_size: int) -> None:
        if self.client_state is None:
            logger.info(f"started from the weights of {self.source} (update 0, fresh optimizer and data order)")
            return
        trainer.load_client_state(self.client_state)
        global_batch = cfg.dataset.batch_size * data_parallel_size
        iterator = self.client_state["iterator"]
        if global_batch != self.saved_global_batch:
            logger.warning(f"global micro-batch {global_batch} differs from the saved {self.saved_global_batch}: "
                           f"epoch {iterator['epoch']} restarts from its first batch")
            iterator = {"epoch": iterator["epoch"], "iterations_in_epoch": 0}
        if not cfg.checkpoint.reset_dataloader:
            epoch_itr.load_state_dict(iterator)
        logger.warning(f"resharded {self.source} ({self.reason}): weights, update {trainer.num_updates}, LR schedule "
                       f"and meters restored; optimizer state was reset (Adam moments restart)")


def hf_restore(cfg) -> WeightsRestore:
    """`--restore-file hf:DIR`: the OPT folder's weights, checked against this run's model flags."""
    from metaseq_ds.convert.hf_import import read_hf_model
    from metaseq_ds.options import flag

    folder = Path(cfg.checkpoint.restore_file[len(HF_PREFIX):])
    fields, state_dict = read_hf_model(folder)
    for name, value in fields.items():
        ours = getattr(cfg.model, name)
        if name in _IGNORED_FIELDS or ours == value:
            continue
        if isinstance(value, bool):
            hint = flag(name) if value else f"no {flag(name)}"
        else:
            hint = f"{flag(name)} {value}" if value is not None else f"no {flag(name)}"
        raise UsageError(f"--restore-file hf:{folder}: the model has {name}={value!r}, this run {ours!r} (use {hint})")
    return WeightsRestore(f"hf:{folder}", lambda: state_dict)


def weights_restore(restore, cfg, world_size: int) -> Optional[WeightsRestore]:
    """How to restore: None for an exact DeepSpeed resume, else the weights to load first."""
    from metaseq_ds import checkpoint_utils
    from metaseq_ds.distributed.deepspeed_config import build_deepspeed_config
    from metaseq_ds.distributed.safe_checkpoint_loading import safe_load

    if isinstance(restore, WeightsRestore):
        return restore
    ref, meta = restore
    if meta.get("weights_only"):
        return WeightsRestore(str(ref.path), lambda: checkpoint_utils.load_model_weights(ref))
    stage = build_deepspeed_config(cfg, world_size, fp16_supported=True)["zero_optimization"]["stage"]
    tp_size = tensor_parallel_size(cfg)
    saved_world, saved_stage, saved_tp = meta["world_size"], meta["zero_stage"], meta.get("tensor_parallel_size", 1)
    if saved_tp == tp_size and ((saved_world, saved_stage) == (world_size, stage) or saved_stage == stage == 0):
        return None
    states_file = "zero_pp_rank_0_mp_rank_00_model_states.pt" if saved_stage == 3 else "mp_rank_00_model_states.pt"
    states = safe_load(ref.path / states_file, map_location="cpu", mmap=True)
    client = {k: states[k] for k in ("num_updates", "lr_scheduler", "metrics", "rng", "iterator")}
    return WeightsRestore(
        str(ref.path), lambda: checkpoint_utils.load_model_weights(ref), client_state=client,
        saved_global_batch=meta["config"]["dataset"]["batch_size"] * saved_world // saved_tp,
        reason=f"saved by {_layout(saved_world, saved_stage, saved_tp)}, now {_layout(world_size, stage, tp_size)}",
    )


def _layout(world_size: int, zero_stage: int, tp_size: int) -> str:
    tp = f" (tensor-parallel {tp_size})" if tp_size > 1 else ""
    return f"{world_size} rank(s){tp} with ZeRO-{zero_stage}"


def _fit_vocabulary_rows(weights: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Saved vocabulary rows into a model padded to more rows (a larger tensor-parallel degree pads
    the vocabulary to a multiple of 8*N): the extra rows are padding symbols and keep their fresh init."""
    fitted = dict(weights)
    for name in ("decoder.embed_tokens.weight", "decoder.output_projection.weight"):
        saved, wanted = weights.get(name), expected.get(name)
        if saved is None or wanted is None or saved.shape[1:] != wanted.shape[1:] or saved.shape[0] >= wanted.shape[0]:
            continue
        grown = wanted.clone()
        grown[: saved.shape[0]] = saved
        fitted[name] = grown
        logger.warning(f"{name}: {saved.shape[0]} saved vocabulary rows, {wanted.shape[0]} now; "
                       f"the {wanted.shape[0] - saved.shape[0]} new padding rows keep their initial values")
    return fitted
