"""Models: the `--arch` registries, the base classes and the built-in `transformer_lm`.

    model = build_model(cfg.model, task)          # cfg.model holds the model's dataclass

`--arch NAME` picks a model and a set of defaults for its config. Plugins keep fairseq's
decorators: `@register_model("name", dataclass=Config)` on a `BaseModel` subclass (this also
registers an architecture of the same name), and `@register_model_architecture("name",
"arch")` on a function `fn(args)` that fills defaults the fairseq way,
`args.x = getattr(args, "x", default)`. The built-in architectures are such functions too,
importable from `metaseq_ds.models.transformer_lm` (`base_lm_architecture`, `opt_125m`, ...).
"""

from metaseq_ds.models.base import (
    BaseDecoder,
    BaseEncoder,
    BaseModel,
    EncoderDecoderModel,
    IncrementalDecoder,
    LanguageModel,
)
from metaseq_ds.models.distributed_model import DistributedModel
from metaseq_ds.models.registry import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_REGISTRY,
    MODEL_REGISTRY,
    arch_defaults,
    build_model,
    register_model,
    register_model_architecture,
)

# Built-ins register on import.
from metaseq_ds.models.transformer_lm import TransformerLanguageModel, TransformerLanguageModelConfig

__all__ = [
    "ARCH_CONFIG_REGISTRY",
    "ARCH_MODEL_REGISTRY",
    "BaseDecoder",
    "BaseEncoder",
    "BaseModel",
    "DistributedModel",
    "EncoderDecoderModel",
    "IncrementalDecoder",
    "LanguageModel",
    "MODEL_REGISTRY",
    "TransformerLanguageModel",
    "TransformerLanguageModelConfig",
    "arch_defaults",
    "build_model",
    "register_model",
    "register_model_architecture",
]
