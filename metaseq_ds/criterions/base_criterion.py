"""`BaseCriterion` (fairseq's FairseqCriterion): a loss over a model's output for one batch."""

import inspect
from typing import Any, Dict, List

from torch import nn


class BaseCriterion(nn.Module):
    """Subclasses implement `forward` and `reduce_metrics`.

    `padding_idx` is the target dictionary's pad id (-100, torch's ignore index, without one).
    """

    # A criterion that computes its loss from this rank's slice of the vocabulary's logits
    # (tensor parallelism) sets this: the model then never gathers the logits for it.
    reads_vocab_parallel_logits = False

    def __init__(self, task):
        super().__init__()
        self.task = task
        dictionary = task.target_dictionary if task is not None else None
        self.padding_idx = dictionary.pad() if dictionary is not None else -100

    @classmethod
    def build_criterion(cls, cfg, task):
        """Call `cls(...)` with `task`, `cfg`, and each other `__init__` argument taken from the cfg
        field of the same name (fairseq's convention, so plugin criterions need no builder)."""
        init_args = {}
        for p in inspect.signature(cls).parameters.values():
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise TypeError(f"{cls.__name__}.__init__ takes *args/**kwargs; define {cls.__name__}.build_criterion")
            if p.name == "task":
                init_args["task"] = task
            elif p.name == "cfg":
                init_args["cfg"] = cfg
            elif hasattr(cfg, p.name):
                init_args[p.name] = getattr(cfg, p.name)
            elif p.default is p.empty:
                raise TypeError(
                    f"{cls.__name__}.__init__ argument {p.name!r} is not a field of its config; "
                    f"define {cls.__name__}.build_criterion"
                )
        return cls(**init_args)

    def forward(self, model, sample, reduce: bool = True):
        """Return (loss, sample_size, logging_output): the loss summed over the batch, the
        denominator of the gradient (`self.sample_size(sample)`), and numbers to log."""
        raise NotImplementedError(f"{type(self).__name__} must define forward")

    def sample_size(self, sample) -> int:
        """The denominator of the gradient for `sample`: the trainer divides the update's summed
        loss by the sum of these over all micro-batches and ranks. It must be known before the
        forward pass (the scale is applied before each micro-batch's backward) and equal the
        sample_size `forward` returns (checked). Default: the number of target tokens, metaseq's
        choice for language models; override for a per-sentence loss (`sample["nsentences"]`)."""
        return sample["ntokens"]

    @staticmethod
    def reduce_metrics(logging_outputs: List[Dict[str, Any]]) -> None:
        """Aggregate the logging outputs of all micro-batches and ranks into metrics.log_* calls."""
        raise NotImplementedError("the criterion must define reduce_metrics")

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        """Whether logging outputs may be summed key by key across ranks before `reduce_metrics`
        (one all-reduce instead of gathering every dict)."""
        return False
