"""The `--criterion` registry. Re-exported by `metaseq_ds.criterions`."""

from metaseq_ds.criterions.base_criterion import BaseCriterion
from metaseq_ds.registry import Registry

CRITERION_REGISTRY = Registry("criterion", "--criterion", base=BaseCriterion)
register_criterion = CRITERION_REGISTRY.register


def build_criterion(criterion_cfg, task) -> BaseCriterion:
    """Build the criterion named by `criterion_cfg._name` for `task`."""
    return CRITERION_REGISTRY.get(criterion_cfg._name).cls.build_criterion(criterion_cfg, task)
