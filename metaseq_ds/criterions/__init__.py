"""Criterions (losses): the `--criterion` registry and the built-in `cross_entropy`
(`vocab_parallel_cross_entropy`, for tensor-parallel runs, is metaseq's
`metaseq_ds.model_parallel.criterions`).

    criterion = build_criterion(cfg.criterion, task)
    loss, sample_size, logging_output = criterion(model, sample)
    type(criterion).reduce_metrics(logging_outputs)  # logs into metaseq_ds.logging.metrics

Plugins register their own with `@register_criterion("name", dataclass=Config)`.
"""

from metaseq_ds.criterions.base_criterion import BaseCriterion
from metaseq_ds.criterions.registry import CRITERION_REGISTRY, build_criterion, register_criterion

# Built-ins register on import.
from metaseq_ds.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig

__all__ = [
    "BaseCriterion",
    "CRITERION_REGISTRY",
    "CrossEntropyCriterion",
    "CrossEntropyCriterionConfig",
    "build_criterion",
    "register_criterion",
]
