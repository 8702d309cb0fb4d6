"""Criterions (losses): the `--criterion` registry and the built-in `cross_entropy`
(`vocab_parallel_cross_entropy`, for tensor-parallel runs, is metaseq's
`metaseq_ds.model_parallel.criterions`).

    criterion = build_criterion(cfg.criterion, task)
    loss, sample_size, logging_output = criterion(model, sample)
    type(criterion).reduce_metrics(logging_outputs)  # logs into metaseq_ds.logging.metrics

Plugins register their own with `@register_criterion("name", dataclass=Config)`.
"""

from metaseq_ds.criterions.base_criterion import BaseCriterion
from metaseq_ds.registry import Registry

CRITERION_REGISTRY = Registry("criterion", "--criterion", base=BaseCriterion)
register_criterion = CRITERION_REGISTRY.register


def build_criterion(criterion_cfg, task) -> BaseCriterion:
    """Build the criterion named by `criterion_cfg._name` for `task`."""
    return CRITERION_REGISTRY.get(criterion_cfg._name).cls.build_criterion(criterion_cfg, task)


# Built-ins register on import (after the registry exists, which they import).
from metaseq_ds.criterions.cross_entropy import CrossEntropyCriterion, CrossEntropyCriterionConfig  # noqa: E402

__all__ = [
    "BaseCriterion",
    "CRITERION_REGISTRY",
    "CrossEntropyCriterion",
    "CrossEntropyCriterionConfig",
    "build_criterion",
    "register_criterion",
]
