"""A plugin written the fairseq way, unchanged: the fixture of tests/test_migrate_plugin.py.

It imports only fairseq names (a model on FairseqDecoder/BaseFairseqModel with a @dataclass
config on FairseqDataclass, a LegacyFairseqTask, a FairseqCriterion), so it runs under
`compat.install()` as it is, and on plain metaseq_ds after `mseq migrate`.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from fairseq import metrics
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.data import Dictionary
from fairseq.dataclass import FairseqDataclass
from fairseq.models import (  # the bases that fairseq's docs/tutorial uses
    BaseFairseqModel,
    FairseqDecoder,
    register_model,
    register_model_architecture,
)
from fairseq.tasks import LegacyFairseqTask, register_task


@dataclass
class BagOfWordsConfig(FairseqDataclass):
    embed_dim: int = field(default=16, metadata={"help": "embedding size"})


class BagOfWordsDecoder(FairseqDecoder):
    def __init__(self, dictionary, embed_dim):
        super().__init__(dictionary)
        self.embed = torch.nn.Embedding(len(dictionary), embed_dim)
        self.out = torch.nn.Linear(embed_dim, len(dictionary))

    def extract_features(self, prev_output_tokens, **kwargs):
        return self.embed(prev_output_tokens).cumsum(dim=1), None

    def output_layer(self, features, **kwargs):
        return self.out(features)


@register_model("bag_of_words", dataclass=BagOfWordsConfig)
class BagOfWordsModel(BaseFairseqModel):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    @classmethod
    def build_model(cls, cfg, task):
        return cls(BagOfWordsDecoder(task.target_dictionary, cfg.embed_dim))

    def forward(self, src_tokens, **kwargs):
        return self.decoder(src_tokens)


@register_model_architecture("bag_of_words", "bag_of_words_tiny")
def bag_of_words_tiny(args):
    args.embed_dim = getattr(args, "embed_dim", 8)


@dataclass
class CountingTaskConfig(FairseqDataclass):
    vocab_size: int = field(default=12, metadata={"help": "symbols besides the specials"})


@register_task("counting", dataclass=CountingTaskConfig)
class CountingTask(LegacyFairseqTask):
    """Sequences 1, 2, 3, ... modulo the vocabulary: next-token prediction that is easy to learn."""

    def __init__(self, args):
        super().__init__(args)
        self.dictionary = Dictionary([f"w{i}" for i in range(args.vocab_size)])

    @property
    def source_dictionary(self):
        return self.dictionary

    @property
    def target_dictionary(self):
        return self.dictionary

    def batch(self, size=4, length=6):
        first = len(self.dictionary) - self.args.vocab_size
        start = torch.arange(size).unsqueeze(1) + torch.arange(length + 1)
        tokens = first + start % self.args.vocab_size
        return {"net_input": {"src_tokens": tokens[:, :-1]}, "target": tokens[:, 1:], "ntokens": size * length}


@dataclass
class TokenNllConfig(FairseqDataclass):
    pass


@register_criterion("token_nll", dataclass=TokenNllConfig)
class TokenNllCriterion(FairseqCriterion):
    def forward(self, model, sample, reduce=True):
        logits, _ = model(**sample["net_input"])
        loss = F.cross_entropy(logits.flatten(0, 1), sample["target"].flatten(), reduction="sum")
        return loss, sample["ntokens"], {"loss": loss.item(), "ntokens": sample["ntokens"]}

    @staticmethod
    def reduce_metrics(logging_outputs):
        metrics.log_scalar("loss", sum(log["loss"] for log in logging_outputs))
