"""A plugin whose config declares allowed ranges, as metaseq_ds's own configs do: the fixture of
tests/test_config_ranges.py (`--user-dir tests/plugins/constrained_plugin`).

A range is part of the field's type (`Annotated[float, Field(ge=0, lt=1)]`); the config stays a
standard-library dataclass with fairseq's `metadata={"help": ...}` (a field written the fairseq
way, as in tests/plugins/fairseq_style_plugin, keeps accepting any value of its type).
"""

from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field

from metaseq_ds.criterions import register_criterion
from metaseq_ds.criterions.cross_entropy import CrossEntropyCriterion
from metaseq_ds.dataclass import MetaseqDataclass


@dataclass
class LabelSmoothedCrossEntropyConfig(MetaseqDataclass):
    label_smoothing: Annotated[float, Field(ge=0, lt=1)] = field(
        default=0.1, metadata={"help": "probability mass spread evenly over the vocabulary"}
    )


@register_criterion("label_smoothed_cross_entropy_ranged", dataclass=LabelSmoothedCrossEntropyConfig)
class LabelSmoothedCrossEntropy(CrossEntropyCriterion):
    def __init__(self, task, label_smoothing):
        super().__init__(task)
        self.eps = label_smoothing

    def token_losses(self, logits, target):
        """(1 - eps) * NLL + eps * the mean NLL over the vocabulary, per target token; 0 at pads."""
        lprobs = torch.log_softmax(logits.float(), dim=-1).flatten(0, 1)  # (B*T, V)
        target = target.flatten()
        nll = -lprobs.gather(1, target[:, None]).squeeze(1)
        losses = (1 - self.eps) * nll - self.eps * lprobs.mean(dim=-1)
        return losses.masked_fill(target == self.padding_idx, 0.0)
