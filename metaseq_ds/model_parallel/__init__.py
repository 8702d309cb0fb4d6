"""Tensor (model) parallelism under metaseq's module paths: `ModelParallelTransformerLanguageModel`
and the `vocab_parallel_cross_entropy` criterion. The plan itself is in
`metaseq_ds.distributed.tensor_parallel`; the groups and rank queries in `metaseq_ds.distributed`."""
