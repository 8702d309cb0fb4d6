"""Tensor (model) parallelism under metaseq's module paths: `ModelParallelTransformerLanguageModel`
and the `vocab_parallel_cross_entropy` criterion, registered when this package is imported
(`metaseq_ds.options.component_registries` does so). The plan itself is in
`metaseq_ds.distributed.tensor_parallel`; the groups and rank queries in `metaseq_ds.distributed`."""

from metaseq_ds.model_parallel import criterions, models

__all__ = ["criterions", "models"]
