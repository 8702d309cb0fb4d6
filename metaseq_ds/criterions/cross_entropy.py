"""`cross_entropy`: next-token cross entropy, summed over non-pad targets, logged in base 2."""

import math
from dataclasses import dataclass
from typing import Optional

from metaseq_ds.criterions.base_criterion import BaseCriterion
from metaseq_ds.criterions.registry import register_criterion
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.logging import metrics
from metaseq_ds.models.transformer_decoder import TransformerDecoder, decoder_of
from metaseq_ds.modules.cross_entropy import cross_entropy


@dataclass
class CrossEntropyCriterionConfig(MetaseqDataclass):
    """cross_entropy has no options."""


@register_criterion("cross_entropy", dataclass=CrossEntropyCriterionConfig)
class CrossEntropyCriterion(BaseCriterion):
    def forward(self, model, sample, reduce: bool = True):
        if reduce and self._loss_in_model(model):
            # The model's own loss: the output projection fused with the loss, no (B, T, V) logits.
            loss, extra = model(**sample["net_input"], target=sample["target"])
            token_losses = extra["token_losses"]
        else:
            logits = model(**sample["net_input"])[0]  # (B, T, V)
            token_losses = self.token_losses(logits, sample["target"])
            loss = token_losses.sum() if reduce else token_losses
        sample_size = self.sample_size(sample)
        logging_output = {
            # Summed in fp64: an fp32 sum of thousands of token losses is off by ~1e-6 relative,
            # enough to hide whether two runs that split the batch differently agree.
            "loss": token_losses.detach().double().sum(),
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output

    def token_losses(self, logits, target):
        """(N,) fp32 losses of the (B, T, V) logits against (B, T) targets; 0 at pads."""
        # The softmax is taken in fp32 (bf16/fp16 over a 50k vocabulary loses too much precision),
        # block by block; the logits are overwritten by their gradient (see modules/cross_entropy.py).
        return cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=self.padding_idx)

    def _loss_in_model(self, model) -> bool:
        """Whether `model` (or the engine's module) computes this criterion's loss from its
        features (`TransformerDecoder.output_loss`): see `_decoder_computing`."""
        return self._decoder_computing(model, CrossEntropyCriterion) is not None

    def _decoder_computing(self, model, owner: type) -> Optional[TransformerDecoder]:
        """The decoder of `model` (or the engine's module) when its output layer is ours and
        this criterion's loss is `owner.token_losses`, the cross entropy of the logits, which
        the decoder can compute from its features; None otherwise (a subclass with another loss)."""
        decoder = decoder_of(model)
        if (decoder is not None and type(decoder).output_layer is TransformerDecoder.output_layer
                and type(self).token_losses is owner.token_losses):
            return decoder
        return None

    @staticmethod
    def reduce_metrics(logging_outputs) -> None:
        loss_sum = sum(log.get("loss", 0) for log in logging_outputs)
        ntokens = sum(log.get("ntokens", 0) for log in logging_outputs)
        sample_size = sum(log.get("sample_size", 0) for log in logging_outputs)
        # In bits (divided by ln 2): metaseq reports base 2, and ppl = 2 ** loss. Not rounded to
        # metaseq's 3 digits: the log's 6 are what tell a resumed run from an unbroken one.
        metrics.log_scalar("loss", loss_sum / sample_size / math.log(2), sample_size)
        if sample_size != ntokens:
            metrics.log_scalar("nll_loss", loss_sum / ntokens / math.log(2), ntokens)
            metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters["nll_loss"].avg, round=None))
        else:
            metrics.log_derived("ppl", lambda meters: metrics.get_perplexity(meters["loss"].avg, round=None))

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True
