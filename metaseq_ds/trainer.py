"""One update of an OPT-style LM on a DeepSpeed engine, plus the state a checkpoint needs.

The engine owns ZeRO partitioning, precision, gradient accumulation and clipping; the
trainer owns what metaseq's trainer owned: loss normalisation over the global batch,
LR schedule, seeds, metrics and the client state of checkpoints.

Loss normalisation: metaseq divides the summed loss of an update by the criterion's sample
size (the number of target tokens, for the LM criteria) over the whole update (all ranks, all
micro-batches). DeepSpeed divides each backward by the accumulation steps and averages
gradients over ranks, so each micro-batch's summed loss is scaled by
steps * ranks / global_sample_size before its backward: the result is exactly metaseq's
gradient, whatever the split of the global batch. That scale must be known before the first
backward, so the criterion declares each micro-batch's sample size up front
(`BaseCriterion.sample_size`), and the size its forward returns is checked against it. With
tensor parallelism "ranks" are the data-parallel ranks: one tensor-parallel group's ranks
see the same batch.
"""

import logging
import random
from typing import Any, Dict, List, Optional

import torch

from metaseq_ds.dataclass import MetaseqConfig
from metaseq_ds.device import to_device
from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed.deepspeed_config import optimizer_group_limit, parameter_groups
from metaseq_ds.checkpoint.safe_loading import use_weights_only_loading
from metaseq_ds.distributed.tied_embedding import StreamedTiedEmbedding, stream_tied_embedding
from metaseq_ds.errors import UsageError
from metaseq_ds.host_memory import release_freed_heap
from metaseq_ds.logging import metrics
from metaseq_ds.logging.reduction import combine_over_ranks, reduce_and_log
from metaseq_ds.models.transformer_decoder import note_left_padding
from metaseq_ds.optim import build_optimizer
from metaseq_ds.optim.lr_scheduler import build_lr_scheduler
from metaseq_ds.optim.fp32_master_weights import share_fp32_master_weights
from metaseq_ds.optim.zero_step import lean_zero_step
from metaseq_ds.validation import validate

logger = logging.getLogger(__name__)


class _EngineBackward:
    """What `task.train_step` calls `optimizer.backward(loss)` on: the engine, with our scale, then
    the tied embedding's deferred gradient (`distributed.tied_embedding`) where there is one."""

    def __init__(self, engine, scale: float, tied_embedding: Optional[StreamedTiedEmbedding]):
        self.engine, self.scale, self.tied_embedding = engine, scale, tied_embedding
        self.backwards = 0  # one object per update: counts its micro-batches

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss * self.scale)
        if self.tied_embedding is not None:
            self.tied_embedding.add_to_gradient_partition(first_micro_step=self.backwards == 0)
        self.backwards += 1


def _squared_norm(tensors: List[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of all `tensors` (fp32: ZeRO-0's plain optimizer steps fp32 gradients),
    a 0-dim tensor on `device`, computed by torch's multi-tensor norm without a host sync."""
    if not tensors:
        return torch.zeros((), device=device)
    return torch.nn.utils.get_total_norm(tensors, norm_type=2.0).square().to(device)


def check_sample_size(criterion, declared: float, returned) -> None:
    """The gradient was scaled by the declared size: a forward that returns another breaks it."""
    if float(returned) != float(declared):
        raise UsageError(
            f"criterion {type(criterion).__name__}: forward returned sample_size {float(returned):g} but "
            f"sample_size(sample) declared {float(declared):g}; they must agree (the gradient is "
            f"divided by the declared size before the backward): override sample_size(sample)")


class Trainer:
    def __init__(self, cfg: MetaseqConfig, task, model: torch.nn.Module, criterion, ds_config: Dict[str, Any]):
        import deepspeed

        self.cfg, self.task, self.criterion = cfg, task, criterion
        self.world_size = dist_utils.get_world_size()
        self.rank = dist_utils.get_global_rank()
        # Batches, seeds and loss sums go by data-parallel rank (the same on one TP group's ranks).
        self.data_parallel_size = dist_utils.get_data_parallel_world_size()
        self.data_parallel_rank = dist_utils.get_data_parallel_rank()
        self.data_parallel_group = dist_utils.get_data_parallel_group()
        self.ds_config = ds_config
        trained = [p for p in model.parameters() if p.requires_grad]
        # ZeRO-1/2 copy a whole optimizer group's gradient at each step: groups of about a layer
        self.optimizer = build_optimizer(cfg.optimizer, parameter_groups(trained, optimizer_group_limit(ds_config, cfg.model)))
        # With tensor parallelism DeepSpeed's group registry is the mpu: the engine then counts
        # data-parallel ranks in its batch arithmetic and reduces ZeRO's gradients over them.
        mpu = deepspeed.utils.groups if dist_utils.get_tensor_model_parallel_world_size() > 1 else None
        self.engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optimizer.optimizer, config=self.ds_config, mpu=mpu
        )
        use_weights_only_loading(self.engine)
        share_fp32_master_weights(self.engine)  # ZeRO in fp32: no second copy of the parameters
        lean_zero_step(self.engine)  # ZeRO's step: no transient copies of whole gradients
        # ZeRO-3 with a tied embedding: its weight read and its gradient made chunk by chunk
        # (and, where activations are recomputed, the loss's logits too)
        self.tied_embedding = stream_tied_embedding(self.engine, cfg.distributed_training.checkpoint_activations)
        self.model = self.engine  # criterion(model, sample) runs the engine's forward
        self.lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, self.optimizer)
        self.num_updates = 0
        self.lr_scheduler.step_update(0)
        self.criterion.to(self.engine.device)

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def get_lr(self) -> float:
        return self.optimizer.get_lr()

    def _seed_for_update(self) -> None:
        """Seed dropout from (seed, update, data-parallel rank): resumed runs draw the same masks as
        unbroken ones, and the ranks of a tensor-parallel group draw the same replicated masks."""
        seed = self.cfg.common.seed + self.num_updates * 1000 + self.data_parallel_rank
        torch.manual_seed(seed)
        random.seed(seed)

    def train_step(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        """One update over `update_freq` micro-batches of this rank.

        Logs into the open `metrics` aggregators as metaseq's trainer does: the criterion's
        metrics (`task.reduce_metrics` on the update's logging outputs, combined over the
        data-parallel ranks), ups, lr, num_updates, gnorm, clip and train_wall.
        Returns the values the criterion logged for this update, with what the divergence
        check reads: the global sample_size and ntokens, gnorm, and whether the step applied.
        Nothing is read from the device (a host sync per update on a GPU): values may be 0-dim
        device tensors, for `logging.reduction.read_values` to read with other updates'."""
        self._seed_for_update()
        metrics.log_start_time("train_wall", priority=800)  # unrounded: our updates can take under a second
        sizes = [self.criterion.sample_size(sample) for sample in samples]
        local = [sum(sizes), sum(s["ntokens"] for s in samples)]
        global_size, global_tokens = self._sum_over_replicas(local)
        scale = len(samples) * self.data_parallel_size / max(global_size, 1.0)
        backward = _EngineBackward(self.engine, scale, self.tied_embedding)
        # Kept as the criterion made them (tensors stay on the device): read once an update.
        logging_outputs = []
        gnorm = None
        for index, (sample, size) in enumerate(zip(samples, sizes)):
            sample = to_device(note_left_padding(sample, self.engine), self.engine.device)
            loss, returned_size, logging_output = self.task.train_step(sample, self.model, self.criterion, backward, self.num_updates)
            check_sample_size(self.criterion, size, returned_size)
            logging_outputs.append(logging_output)
            if index == len(samples) - 1 and self._plain_optimizer:
                gnorm = self._local_grad_norm()
            self.engine.step()
        release_freed_heap(self.engine.device)  # a CPU rank's heap keeps the step's freed transients resident
        self.num_updates += 1
        lr = self.lr_scheduler.step_update(self.num_updates)
        logging_outputs = combine_over_ranks(logging_outputs, self.criterion.logging_outputs_can_be_summed(),
                                             group=self.data_parallel_group, read=False)
        gnorm = self._engine_grad_norm() if gnorm is None else gnorm
        step_applied = self.engine.was_step_applied()
        self._log_update_stats(lr, gnorm, step_applied)
        values = reduce_and_log(self.task, self.criterion, logging_outputs, read=False)
        metrics.log_stop_time("train_wall")
        for window_only in ("wps", "wpb", "bsz"):  # the log line's: one update's speed is no speed
            values.pop(window_only, None)
        # False when DeepSpeed's overflow check (fp16 loss scaling, bf16) skipped the step.
        return {**values, "sample_size": global_size, "ntokens": global_tokens, "gnorm": gnorm,
                "step_applied": step_applied}

    def _log_update_stats(self, lr: float, gnorm, step_applied: bool) -> None:
        """The optimizer's side of metaseq's train_inner line (keys, priorities and rounding as metaseq).
        `gnorm` may be a device tensor: the meters keep it there until the log line reads them."""
        metrics.log_speed("ups", 1.0, priority=100, round=2)
        metrics.log_scalar("num_updates", self.num_updates, weight=0, priority=200)
        metrics.log_scalar("lr", lr, weight=0, priority=300)
        # A skipped step's norm (an overflow, inf) would spoil the window's average. An applied
        # step's non-finite norm stops the run before its line is logged (`divergence`).
        if step_applied:
            metrics.log_scalar("gnorm", gnorm, priority=400)  # unrounded, as the loss: runs are compared by it
            clip_norm = self.cfg.optimization.clip_norm
            if clip_norm > 0:  # the share of updates clipped, in percent
                metrics.log_scalar("clip", (gnorm > clip_norm) * 100.0, priority=500, round=1)

    @property
    def _plain_optimizer(self) -> bool:
        """ZeRO-0 in fp32 steps the torch optimizer directly and records no gradient norm."""
        return self.zero_stage == 0 and not (self.engine.bfloat16_enabled() or self.engine.fp16_enabled())

    def _sum_over_replicas(self, values: List[float]) -> List[float]:
        return dist_utils.all_reduce_sum(values, group=self.data_parallel_group)

    def _local_grad_norm(self) -> torch.Tensor:
        """Pre-clipping norm of the full gradient (ZeRO-0: every rank holds all of it, averaged),
        a 0-dim float64 tensor on the device, unread.

        A tensor-parallel shard's squares are summed over its group; replicated parameters count once.
        """
        grads = {True: [], False: []}  # by tensor_model_parallel
        for p in self.engine.module.parameters():
            if p.grad is not None:
                grads[getattr(p, "tensor_model_parallel", False)].append(p.grad.detach())
        device = self.engine.device
        sharded = _squared_norm(grads[True], device).double()
        tp_group = dist_utils.get_tensor_model_parallel_group()
        if tp_group is not None:
            torch.distributed.all_reduce(sharded, group=tp_group)
        return (sharded + _squared_norm(grads[False], device).double()).sqrt()

    def _engine_grad_norm(self):
        """DeepSpeed's norm of the update's gradient: a number, or a tensor left unread."""
        norm = self.engine.get_global_grad_norm()
        return 0.0 if norm is None else norm

    def validate(self, batches, max_steps=None) -> Dict[str, float]:
        """`validation.validate` on the engine, combined over the data-parallel ranks."""
        return validate(self.task, self.model, self.criterion, batches, max_steps, device=self.engine.device,
                        group=self.data_parallel_group)

    # -- state for checkpoints (DeepSpeed saves it as the engine's "client state") -----------
    def state_dict(self) -> Dict[str, Any]:
        return {
            "num_updates": self.num_updates,
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "metrics": metrics.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "task_state": self.task.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.num_updates = state["num_updates"]
        if not self.cfg.checkpoint.reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.lr_scheduler.step_update(self.num_updates)
        if not self.cfg.checkpoint.reset_meters:
            metrics.load_state_dict(state["metrics"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if "task_state" in state:  # absent from checkpoints saved before tasks kept state
            self.task.load_state_dict(state["task_state"])
