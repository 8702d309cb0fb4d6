"""metaseq's `metaseq.model_parallel.criterions`: `vocab_parallel_cross_entropy`."""

from metaseq_ds.model_parallel.criterions.vocab_parallel_cross_entropy import (
    VocabParallelCrossEntropyCriterion,
    VocabParallelCrossEntropyCriterionConfig,
)

__all__ = ["VocabParallelCrossEntropyCriterion", "VocabParallelCrossEntropyCriterionConfig"]
