"""`inverse_sqrt`: linear warmup to --lr, then decay proportional to 1/sqrt(update)."""

from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import PositiveFloat, PositiveInt
from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.optim.lr_scheduler.registry import register_lr_scheduler


@dataclass
class InverseSquareRootLRScheduleConfig(MetaseqDataclass):
    warmup_updates: PositiveInt = field(
        default=4000, metadata={"help": "warmup the learning rate linearly for the first N updates"}
    )
    warmup_init_lr: Annotated[float, Field(ge=-1)] = field(
        default=-1, metadata={"help": "initial learning rate during warmup phase; -1: 0"}
    )
    lr: PositiveFloat = field(default=0.25, metadata={"help": "same as --lr"})


@register_lr_scheduler("inverse_sqrt", dataclass=InverseSquareRootLRScheduleConfig)
class InverseSquareRootSchedule(BaseLRScheduler):
    """t < W: init + t * (lr - init) / W;  t >= W: lr * sqrt(W / t)."""

    def __init__(self, cfg: InverseSquareRootLRScheduleConfig, optimizer):
        super().__init__(cfg, optimizer)
        self.warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else 0.0
        self.lr_step = (cfg.lr - self.warmup_init_lr) / cfg.warmup_updates
        self.decay_factor = cfg.lr * cfg.warmup_updates**0.5
        self.step_update(0)

    def lr_at(self, num_updates: int) -> float:
        if num_updates < self.cfg.warmup_updates:
            return self.warmup_init_lr + num_updates * self.lr_step
        return self.decay_factor * num_updates**-0.5
