"""The plugin of tests/plugins/lm_fairseq written against metaseq_ds's own names (nothing to migrate),
as a new user writes it: a label-smoothed criterion whose
reduce_metrics logs loss, nll_loss and a derived ppl; a second that also reports a maximum (not
summable: its outputs are gathered); an architecture chained on base_lm_architecture; a task that
keeps a value in its `state` and logs it.
"""

import math
import os
from dataclasses import dataclass, field

from metaseq_ds import utils
from metaseq_ds.logging import metrics
from metaseq_ds.criterions import BaseCriterion, register_criterion
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.models import register_model_architecture
from metaseq_ds.models.transformer_lm import base_lm_architecture
from metaseq_ds.tasks import register_task
from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig, StreamingLanguageModelingTask


@register_model_architecture("transformer_lm", "plugin_lm_tiny")
def plugin_lm_tiny(args):
    args.decoder_layers = getattr(args, "decoder_layers", 2)
    args.decoder_embed_dim = getattr(args, "decoder_embed_dim", 32)
    args.decoder_ffn_embed_dim = getattr(args, "decoder_ffn_embed_dim", 64)
    args.decoder_attention_heads = getattr(args, "decoder_attention_heads", 2)
    base_lm_architecture(args)


@dataclass
class StampedLanguageModelingConfig(StreamingLanguageModelingConfig):
    pass


@register_task("stamped_lm", dataclass=StampedLanguageModelingConfig)
class StampedLanguageModelingTask(StreamingLanguageModelingTask):
    """Logs a stamp made once, by the first process: the task's state keeps it across checkpoints."""

    def __init__(self, args):
        super().__init__(args)
        self.state.add_factory("stamp", lambda: float(os.getpid()))

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        metrics.log_scalar("task_stamp", self.state.stamp, weight=0, priority=250)


@dataclass
class LabelSmoothedLMConfig(MetaseqDataclass):
    label_smoothing: float = field(default=0.1, metadata={"help": "epsilon for label smoothing, 0 means no label smoothing"})


@register_criterion("label_smoothed_lm", dataclass=LabelSmoothedLMConfig)
class LabelSmoothedLMCriterion(BaseCriterion):
    def __init__(self, task, label_smoothing):
        super().__init__(task)
        self.eps = label_smoothing

    def forward(self, model, sample, reduce=True):
        net_output = model(**sample["net_input"])
        lprobs = model.get_normalized_probs(net_output, log_probs=True)
        target = model.get_targets(sample, net_output)
        pad = target.eq(self.padding_idx)
        nll = -lprobs.gather(-1, target.masked_fill(pad, 0).unsqueeze(-1)).squeeze(-1).masked_fill(pad, 0.0)
        smooth = -lprobs.mean(-1).masked_fill(pad, 0.0)
        loss = ((1.0 - self.eps) * nll + self.eps * smooth).sum()
        sample_size = sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll.sum().data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        self.add_to_logging_output(logging_output, nll, pad)
        return loss, sample_size, logging_output

    def add_to_logging_output(self, logging_output, nll, pad):
        pass

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        nll_loss_sum = sum(log.get("nll_loss", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size, round=3)
        metrics.log_scalar("nll_loss", nll_loss_sum / ntokens / math.log(2), ntokens, round=3)
        metrics.log_derived("ppl", lambda meters: utils.get_perplexity(meters["nll_loss"].avg))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True


@register_criterion("worst_sentence_lm", dataclass=LabelSmoothedLMConfig)
class WorstSentenceLMCriterion(LabelSmoothedLMCriterion):
    """Also the worst sentence's mean nll: a maximum, so the outputs are gathered, not summed."""

    def add_to_logging_output(self, logging_output, nll, pad):
        logging_output["sentence_nll"] = (nll.sum(-1) / (~pad).sum(-1).clamp(min=1)).data

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        LabelSmoothedLMCriterion.reduce_metrics(logging_outputs)
        worst = max(utils.item(log["sentence_nll"].max()) for log in logging_outputs)
        metrics.log_scalar("worst_sentence_nll", worst / math.log(2), round=3)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False
