"""`ModelParallelTransformerLanguageModel`: metaseq's tensor-parallel LM, rebuilt as the plain
`TransformerLanguageModel` with the tensor-parallel plan applied after construction.

metaseq built this model from Megatron's parallel layers, querying process groups inside
every constructor. Here the model is the plain one and `apply_tensor_parallel` swaps its
projections and embeddings for DeepSpeed's tensor-parallel layers, so the parameter names,
the checkpoints' keys and the numerics are those of `transformer_lm`.

`mseq train --arch opt_125m --model-parallel-size 2` gets this model (the plan is applied by
`parallelize`); scripts can build it directly once the groups exist:

    init_distributed(tensor_parallel_size=2)
    model = ModelParallelTransformerLanguageModel.build_model(cfg, task)   # this rank's shard
"""

from dataclasses import dataclass

from metaseq_ds.distributed.tensor_parallel import apply_tensor_parallel
from metaseq_ds.models import register_model
from metaseq_ds.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig


@dataclass
class ModelParallelTransformerLanguageModelConfig(TransformerLanguageModelConfig):
    """transformer_lm's fields; the degree is --model-parallel-size (a distributed-training flag)."""


@register_model("model_parallel_transformer_lm", dataclass=ModelParallelTransformerLanguageModelConfig)
class ModelParallelTransformerLanguageModel(TransformerLanguageModel):
    @classmethod
    def build_model(cls, cfg, task):
        """The plain model, sharded over the tensor-parallel group (unchanged without one)."""
        return apply_tensor_parallel(super().build_model(cfg, task))
