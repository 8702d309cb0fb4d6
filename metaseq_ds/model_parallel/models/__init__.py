"""metaseq's `metaseq.model_parallel.models`: `ModelParallelTransformerLanguageModel`."""

from metaseq_ds.model_parallel.models.transformer_lm import (
    ModelParallelTransformerLanguageModel,
    ModelParallelTransformerLanguageModelConfig,
)

__all__ = ["ModelParallelTransformerLanguageModel", "ModelParallelTransformerLanguageModelConfig"]
