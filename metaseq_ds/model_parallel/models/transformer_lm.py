"""`ModelParallelTransformerLanguageModel`: metaseq's tensor-parallel LM under its metaseq name.

metaseq built this model from Megatron's parallel layers, querying process groups inside
every constructor. Here it is the plain `TransformerLanguageModel` (same parameter names,
checkpoint keys and numerics); tensor parallelism is applied from outside, after
construction, by `metaseq_ds.distributed.parallelize`, as for any model:

    init_distributed(tensor_parallel_size=2)
    model = ModelParallelTransformerLanguageModel.build_model(cfg, task)   # plain, whole
    model = parallelize(model, cfg)                                        # this rank's shard

`mseq train --arch opt_125m --model-parallel-size 2` does the same with `transformer_lm`.
"""

from dataclasses import dataclass

from metaseq_ds.models import register_model
from metaseq_ds.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig


@dataclass
class ModelParallelTransformerLanguageModelConfig(TransformerLanguageModelConfig):
    """transformer_lm's fields; the degree is --model-parallel-size (a distributed-training flag)."""


@register_model("model_parallel_transformer_lm", dataclass=ModelParallelTransformerLanguageModelConfig)
class ModelParallelTransformerLanguageModel(TransformerLanguageModel):
    """The plain transformer LM, registered under metaseq's model-parallel name."""
