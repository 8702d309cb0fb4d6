"""Optimizers: the `--optimizer` registry and the built-ins `adam` and `sgd`.

    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer.optimizer, ...)

Plugins register their own with `@register_optimizer("name", dataclass=Config)`.
"""

from metaseq_ds.optim.base_optimizer import BaseOptimizer, LegacyOptimizer
from metaseq_ds.optim.registry import OPTIMIZER_REGISTRY, build_optimizer, check_optimizer_kernels, register_optimizer

# Built-ins register on import.
from metaseq_ds.optim.adam import MetaseqAdam, MetaseqAdamConfig
from metaseq_ds.optim.sgd import MetaseqSGDW, MetaseqSGDWConfig

__all__ = [
    "BaseOptimizer",
    "LegacyOptimizer",
    "MetaseqAdam",
    "MetaseqAdamConfig",
    "MetaseqSGDW",
    "MetaseqSGDWConfig",
    "OPTIMIZER_REGISTRY",
    "build_optimizer",
    "register_optimizer",
]
