"""`vocab_parallel_cross_entropy`: cross entropy on vocabulary-sharded logits, never gathered.

metaseq's criterion for model-parallel runs. Under tensor parallelism the output projection
gives each rank the logits of its slice of the vocabulary, (B, T, V/N); DeepSpeed's
`vocab_parallel_cross_entropy` all-reduces the row maximum, the sum of exponentials and the
target's logit over the tensor-parallel group, so the (B, T, V) logits never exist on one
rank. Without tensor parallelism it is the plain cross entropy.

Where the decoder fuses its projection with the loss (`TransformerDecoder.fuses_output_loss`:
the tensor-parallel head does, as the plain model's does) not even the shards are made: the
decoder computes the same loss a chunk of rows at a time, each rank's log-normalisers and
target logits of a chunk all-gathered over the group. The shards are read as above only where
it cannot (ZeRO-3 streaming a tied embedding) and with reduce=False.
"""

from dataclasses import dataclass

from metaseq_ds.criterions import register_criterion
from metaseq_ds.criterions.cross_entropy import CrossEntropyCriterion
from metaseq_ds.dataclass import MetaseqDataclass


@dataclass
class VocabParallelCrossEntropyCriterionConfig(MetaseqDataclass):
    """vocab_parallel_cross_entropy has no options."""


@register_criterion("vocab_parallel_cross_entropy", dataclass=VocabParallelCrossEntropyCriterionConfig)
class VocabParallelCrossEntropyCriterion(CrossEntropyCriterion):
    reads_vocab_parallel_logits = True

    def _loss_in_model(self, model) -> bool:
        # Only where the projection fuses the loss: the decoder's logits path would take the
        # cross entropy of whole logits, which the head does not gather for this criterion.
        decoder = self._decoder_computing(model, VocabParallelCrossEntropyCriterion)
        return decoder is not None and decoder.fuses_output_loss()

    def token_losses(self, logits, target):
        """`logits` are (B, T, V/N): this rank's slice of the vocabulary."""
        from deepspeed.sequence import vocab_parallel_cross_entropy

        from metaseq_ds.distributed import utils as dist_utils

        shard = logits.size(-1)
        start = dist_utils.get_tensor_model_parallel_rank() * shard
        # The loss is computed in fp32 inside (bf16 logits are upcast one shard at a time).
        return vocab_parallel_cross_entropy(
            logits,
            target,
            tp_group=dist_utils.get_tensor_model_parallel_group(),
            vocab_start_index=start,
            vocab_end_index=start + shard,
            global_vocab_size=shard * dist_utils.get_tensor_model_parallel_world_size(),
            ignore_index=self.padding_idx,
            reduction="none",
        ).view(-1)
