"""`BaseTask` (fairseq's `FairseqTask`) and `LegacyTask` (`LegacyFairseqTask`): what a task does.

A task owns the data side of training: the dictionary, loading splits, the batch iterator,
the per-step glue between model, criterion and optimizer (`train_step`, `valid_step`), and the
generator that decodes with the trained model (`build_generator`, `inference_step`). What it
must keep across checkpoints lives in `self.state` (`StatefulContainer`). Plugin tasks subclass
one of these and register with `@register_task(name, dataclass=...)`.
"""

import logging
import os
from argparse import ArgumentParser
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from metaseq_ds.data.dictionary import Dictionary
from metaseq_ds.dataclass.utils import gen_parser_from_dataclass
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.logging import metrics
from metaseq_ds.sequence_generator import SequenceGenerator, options_from_generation_config
from metaseq_ds.tasks.stateful_container import StatefulContainer, checkpointable

logger = logging.getLogger(__name__)


class BaseTask:
    """A task configured by its dataclass config `cfg` (the `task` section of the run's config)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.datasets: Dict[str, Any] = {}
        self.state = StatefulContainer()

    @classmethod
    def add_args(cls, parser: ArgumentParser) -> None:
        """Add the task's options to `parser`: its config's fields (fairseq-style tasks override this)."""
        config = getattr(cls, "__dataclass", None)  # set by register_task; a plain getattr: the name is not mangled
        if config is not None:
            gen_parser_from_dataclass(parser, config())

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs) -> "BaseTask":
        """Build the task; override to load dictionaries or tokenizers before construction."""
        return cls(cfg, **kwargs)

    @classmethod
    def load_dictionary(cls, filename: str) -> Dictionary:
        """The dictionary of a fairseq `dict.txt`."""
        return Dictionary.load(filename)

    @classmethod
    def build_dictionary(cls, filenames: Sequence[str], workers: int = 1, threshold: int = -1, nwords: int = -1,
                         padding_factor: int = 8) -> Dictionary:
        """A dictionary of the whitespace-separated words of text files, as fairseq builds one:
        most frequent first, words seen fewer than `threshold` times left out, at most `nwords`
        symbols (specials included; -1: all), padded to a multiple of `padding_factor`; `workers`
        processes count each file."""
        dictionary = Dictionary()
        for filename in filenames:
            Dictionary.add_file_to_dictionary(filename, dictionary, num_workers=workers)
        dictionary.finalize(threshold=threshold, nwords=nwords, padding_factor=padding_factor)
        return dictionary

    def has_sharded_data(self, split: str) -> bool:
        """Whether the data is several directories (`DATA1:DATA2:...`), fairseq's one per epoch."""
        return os.pathsep in str(getattr(self.cfg, "data", None) or "")  # a task's config need not have data

    def load_dataset(self, split: str, epoch: int = 1, **kwargs) -> None:
        """Load `split` into `self.datasets[split]`."""
        raise NotImplementedError(f"{type(self).__name__} must define load_dataset")

    def dataset(self, split: str) -> Any:
        if split not in self.datasets:
            raise KeyError(f"dataset not loaded: {split}")
        return self.datasets[split]

    def filter_indices_by_size(self, indices: np.ndarray, dataset, max_positions: Optional[int] = None,
                               ignore_invalid_inputs: bool = False) -> np.ndarray:
        """`indices` of `dataset` without the items longer than `max_positions` (`dataset.size`):
        an error names the first such item, or, with `ignore_invalid_inputs`, a warning counts them."""
        indices, ignored = dataset.filter_indices_by_size(indices, max_positions)
        if ignored and not ignore_invalid_inputs:
            raise UsageError(f"sample #{ignored[0]} has size {dataset.size(ignored[0])}, more than max_positions="
                             f"{max_positions}; skip such samples with ignore_invalid_inputs")
        if ignored:
            logger.warning(f"{len(ignored):,} samples are longer than max_positions={max_positions} and are skipped; "
                           f"the first ids: {ignored[:10]}")
        return indices

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

    def build_generator(self, models: Sequence[torch.nn.Module], args: Any, seq_gen_cls=None,
                        extra_gen_cls_kwargs: Optional[Dict[str, Any]] = None):
        """A `SequenceGenerator` (or `seq_gen_cls`) over `models` as metaseq's generation flags in
        `args` say (`sequence_generator.options_from_generation_config`: a `GenerationConfig`, a
        namespace of `options.get_generation_parser`, or `GenerationOptions` as they are).

        `extra_gen_cls_kwargs` named as `GenerationOptions` fields (`stop`, `logprobs`, `seed`, ...)
        set those options; the others go to the generator class (`decode=` for stop strings).
        """
        options = args if isinstance(args, GenerationOptions) else options_from_generation_config(args)
        extra = dict(extra_gen_cls_kwargs or {})
        changes = {name: extra.pop(name) for name in list(extra) if name in GenerationOptions.model_fields}
        if changes:
            options = options.replace(**changes)
        return (seq_gen_cls or SequenceGenerator)(models, self.target_dictionary, options, **extra)

    def inference_step(self, generator, models, sample, prefix_tokens: Optional[torch.Tensor] = None):
        """The generator's hypotheses for each prompt of `sample` (token-id prompts, or
        `{"net_input": {"src_tokens": (B, T)}}`)."""
        if prefix_tokens is not None:  # metaseq accepted and ignored it
            raise UsageError("inference_step: prefix_tokens is not supported by decoder-only generation; "
                             "append the prefix to each prompt")
        with torch.no_grad():
            return generator.generate(models, sample)

    def build_tokenizer(self, args: Any) -> None:
        """fairseq's pre-tokenizer (`--tokenizer`, e.g. moses): none here, as in metaseq, which
        registered none; text goes straight to the task's tokenizer (`build_bpe`)."""
        if getattr(args, "tokenizer", None) is not None:  # args of any shape: metaseq's cfg.tokenizer may be absent
            raise UsageError(f"--tokenizer {args.tokenizer}: metaseq_ds has no pre-tokenizers; the task's tokenizer "
                             "maps text to ids (see build_bpe)")
        return None

    def build_bpe(self, args: Any):
        """The task's text <-> ids tokenizer (fairseq's `--bpe` registry is not rebuilt: a task picks
        its tokenizer from its own flags, see `metaseq_ds.data.tokenizers`)."""
        raise UsageError(f"{type(self).__name__} has no tokenizer: metaseq_ds's tokenizers (GPT-2 byte BPE, a "
                         "tokenizer.json, bytes) are built by metaseq_ds.data.build_tokenizer from the "
                         "streaming_language_modeling flags --hf-tokenizer or --vocab-filename/--merges-filename")

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

    def state_dict(self) -> Dict[str, Any]:
        """What checkpoints keep of the task (metaseq's `task_state`): `self.state`'s pieces."""
        state = self.state.state_dict
        checkpointable(state)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.state.merge_state_dict(state_dict)

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

    @classmethod
    def setup_task(cls, args: Any, **kwargs) -> "LegacyTask":
        return cls(args, **kwargs)
