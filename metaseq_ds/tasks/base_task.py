"""`BaseTask` (fairseq's `FairseqTask`) and `LegacyTask` (`LegacyFairseqTask`): what a task does.

A task owns the data side of training: the dictionary, loading splits, the batch iterator,
and the per-step glue between model, criterion and optimizer (`train_step`, `valid_step`).
Plugin tasks subclass one of these and register with `@register_task(name, dataclass=...)`.
"""

from argparse import ArgumentParser
from typing import Any, Dict, List, Optional, Tuple

import torch

from metaseq_ds.logging import metrics


class BaseTask:
    """A task configured by its dataclass config `cfg` (the `task` section of the run's config)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.datasets: Dict[str, Any] = {}

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs) -> "BaseTask":
        """Build the task; override to load dictionaries or tokenizers before construction."""
        return cls(cfg, **kwargs)

    def load_dataset(self, split: str, epoch: int = 1, **kwargs) -> None:
        """Load `split` into `self.datasets[split]`."""
        raise NotImplementedError(f"{type(self).__name__} must define load_dataset")

    def dataset(self, split: str) -> Any:
        if split not in self.datasets:
            raise KeyError(f"dataset not loaded: {split}")
        return self.datasets[split]

    def get_batch_iterator(self, split: str, batch_size: int, seed: int = 1, num_shards: int = 1, shard_id: int = 0,
                           epoch: int = 1, num_workers: int = 0, data_buffer_size: int = 0):
        """An `EpochBatchIterator` over this rank's micro-batches of `split`; `num_workers` and
        `data_buffer_size` (metaseq's flags) say how batches are prepared ahead of the step."""
        raise NotImplementedError(f"{type(self).__name__} must define get_batch_iterator")

    def build_model(self, model_cfg: Any):
        from metaseq_ds import models  # imported here so that tasks import without any model code

        return models.build_model(model_cfg, self)

    def build_criterion(self, criterion_cfg: Any):
        from metaseq_ds import criterions

        return criterions.build_criterion(criterion_cfg, self)

    def begin_epoch(self, epoch: int, model) -> None:
        """Hook called by the trainer at the start of each training epoch."""

    def begin_valid_epoch(self, epoch: int, model) -> None:
        """Hook called by the trainer before each validation pass."""

    def train_step(self, sample, model, criterion, optimizer, update_num: int, ignore_grad: bool = False) -> Tuple[torch.Tensor, Any, Dict]:
        """Forward and backward on one micro-batch; `ignore_grad` zeroes its gradient contribution
        (a rank's dummy batch) while keeping every rank's collectives in step."""
        model.train()
        loss, sample_size, logging_output = criterion(model, sample)
        if ignore_grad:
            loss *= 0
        optimizer.backward(loss)
        return loss, sample_size, logging_output

    def valid_step(self, sample, model, criterion) -> Tuple[torch.Tensor, Any, Dict]:
        model.eval()
        with torch.no_grad():
            loss, sample_size, logging_output = criterion(model, sample)
        return loss, sample_size, logging_output

    def reduce_metrics(self, logging_outputs: List[Dict], criterion) -> None:
        """Log the batch's size and speed (metaseq's wpb, wps, bsz), then the criterion's metrics.

        `logging_outputs` are an update's (or a validation split's), combined over the ranks."""
        if any("ntokens" in log for log in logging_outputs):
            ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
            metrics.log_scalar("wpb", ntokens, priority=180, round=1)
            metrics.log_speed("wps", ntokens, priority=90, round=1)
        if any("nsentences" in log for log in logging_outputs):
            metrics.log_scalar("bsz", sum(log.get("nsentences", 0) for log in logging_outputs), priority=190, round=1)
        criterion.__class__.reduce_metrics(logging_outputs)

    def max_positions(self) -> Optional[int]:
        """The longest sequence the task produces (None: no limit)."""
        return None

    @property
    def source_dictionary(self):
        raise NotImplementedError(f"{type(self).__name__} must define source_dictionary")

    @property
    def target_dictionary(self):
        raise NotImplementedError(f"{type(self).__name__} must define target_dictionary")


class LegacyTask(BaseTask):
    """A task configured by an argparse-style namespace `args`, as fairseq's LegacyFairseqTask.

    `args` may be a `Namespace` or the task's dataclass config: both are read by attribute.
    """

    def __init__(self, args: Any):
        super().__init__(args)
        self.args = args

    @staticmethod
    def add_args(parser: ArgumentParser) -> None:
        """Hook: add task-specific flags to `parser` (legacy tasks without a dataclass config)."""

    @classmethod
    def setup_task(cls, args: Any, **kwargs) -> "LegacyTask":
        return cls(args, **kwargs)
