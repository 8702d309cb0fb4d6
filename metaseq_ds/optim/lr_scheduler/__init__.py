"""LR schedulers: the `--lr-scheduler` registry and metaseq's schedules.

    lr_scheduler = build_lr_scheduler(cfg.lr_scheduler, optimizer)  # sets the lr for update 0
    ...
    lr_scheduler.step_update(num_updates)  # after every update

Plugins register their own with `@register_lr_scheduler("name", dataclass=Config)`.
"""

from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.optim.lr_scheduler.registry import LR_SCHEDULER_REGISTRY, build_lr_scheduler, register_lr_scheduler

# Built-ins register on import.
from metaseq_ds.optim.lr_scheduler.cosine_lr_scheduler import (
    CosineLRSchedule,
    CosineLRScheduleConfig,
)
from metaseq_ds.optim.lr_scheduler.inverse_square_root_schedule import (
    InverseSquareRootLRScheduleConfig,
    InverseSquareRootSchedule,
)
from metaseq_ds.optim.lr_scheduler.polynomial_decay_schedule import (
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
