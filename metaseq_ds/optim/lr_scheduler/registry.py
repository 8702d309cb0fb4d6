"""The `--lr-scheduler` registry. Re-exported by `metaseq_ds.optim.lr_scheduler`."""

from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.registry import Registry

LR_SCHEDULER_REGISTRY = Registry("lr_scheduler", "--lr-scheduler", base=BaseLRScheduler)
register_lr_scheduler = LR_SCHEDULER_REGISTRY.register


def build_lr_scheduler(lr_scheduler_cfg, optimizer) -> BaseLRScheduler:
    """Build the schedule named by `lr_scheduler_cfg._name`, driving `optimizer` (a BaseOptimizer)."""
    return LR_SCHEDULER_REGISTRY.get(lr_scheduler_cfg._name).cls(lr_scheduler_cfg, optimizer)
