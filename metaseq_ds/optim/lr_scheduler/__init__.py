"""LR schedulers: the `--lr-scheduler` registry and metaseq's schedules.

    lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, optimizer)  # sets the lr for update 0
    ...
    lr_scheduler.step_update(num_updates)  # after every update

Plugins register their own with `@register_lr_scheduler("name", dataclass=Config)`.
"""

from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.registry import Registry

LR_SCHEDULER_REGISTRY = Registry("lr_scheduler", "--lr-scheduler", base=BaseLRScheduler)
register_lr_scheduler = LR_SCHEDULER_REGISTRY.register


def build_lr_scheduler(lr_scheduler_cfg, optimizer) -> BaseLRScheduler:
    """Build the schedule named by `lr_scheduler_cfg._name`, driving `optimizer` (a BaseOptimizer)."""
    return LR_SCHEDULER_REGISTRY.get(lr_scheduler_cfg._name).cls(lr_scheduler_cfg, optimizer)


# Built-ins register on import (after the registry exists, which they import).
from metaseq_ds.optim.lr_scheduler.cosine_lr_scheduler import (  # noqa: E402
    CosineLRSchedule,
    CosineLRScheduleConfig,
)
from metaseq_ds.optim.lr_scheduler.inverse_square_root_schedule import (  # noqa: E402
    InverseSquareRootLRScheduleConfig,
    InverseSquareRootSchedule,
)
from metaseq_ds.optim.lr_scheduler.polynomial_decay_schedule import (  # noqa: E402
    PolynomialDecayLRSchedule,
    PolynomialDecayLRScheduleConfig,
)

__all__ = [
    "BaseLRScheduler",
    "CosineLRSchedule",
    "CosineLRScheduleConfig",
    "InverseSquareRootLRScheduleConfig",
    "InverseSquareRootSchedule",
    "LR_SCHEDULER_REGISTRY",
    "PolynomialDecayLRSchedule",
    "PolynomialDecayLRScheduleConfig",
    "build_lr_scheduler",
    "register_lr_scheduler",
]
