"""`cosine`: linear warmup, then cosine annealing with warm restarts (SGDR, arXiv:1608.03983).

Period i lasts period * t_mult**i updates and anneals from lr * lr_shrink**i down to
min_lr * lr_shrink**i.
"""

import math
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import NonNegativeFloat, NonNegativeInt, PositiveFloat
from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.optim.lr_scheduler.registry import register_lr_scheduler


@dataclass
class CosineLRScheduleConfig(MetaseqDataclass):
    warmup_updates: NonNegativeInt = field(
        default=0, metadata={"help": "warmup the learning rate linearly for the first N updates"}
    )
    warmup_init_lr: Annotated[float, Field(ge=-1)] = field(
        default=-1, metadata={"help": "initial learning rate during warmup phase; -1: --min-lr"}
    )
    lr: PositiveFloat = field(default=0.25, metadata={"help": "same as --lr: the max learning rate, must be more than --min-lr"})
    min_lr: NonNegativeFloat = field(default=0.0, metadata={"help": "min learning rate"})
    # Periods shrinking (t_mult < 1) would end after a finite number of updates.
    t_mult: Annotated[float, Field(ge=1)] = field(default=1.0, metadata={"help": "factor to grow the length of each period"})
    lr_period_updates: Annotated[float, Field(ge=-1)] = field(
        default=-1, metadata={"help": "initial number of updates per period; -1 or 0: --max-update minus warmup"}
    )
    lr_shrink: Annotated[float, Field(gt=0, le=1)] = field(default=0.1, metadata={"help": "shrink factor for annealing"})
    max_update: NonNegativeInt = field(default=0, metadata={"help": "same as --max-update"})

    def __post_init__(self):
        if self.lr <= self.min_lr:
            raise ValueError(f"cosine needs --lr (={self.lr}) more than --min-lr (={self.min_lr})")
        if self.lr_period_updates <= 0 and self.max_update <= self.warmup_updates:
            raise ValueError(
                "cosine needs --lr-period-updates > 0 or --max-update > --warmup-updates "
                f"(got {self.max_update} and {self.warmup_updates})"
            )


@register_lr_scheduler("cosine", dataclass=CosineLRScheduleConfig)
class CosineLRSchedule(BaseLRScheduler):
    def __init__(self, cfg: CosineLRScheduleConfig, optimizer):
        super().__init__(cfg, optimizer)
        self.period = cfg.lr_period_updates
        if self.period <= 0:
            self.period = cfg.max_update - cfg.warmup_updates
        self.warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else cfg.min_lr
        if cfg.warmup_updates > 0:
            self.lr_step = (cfg.lr - self.warmup_init_lr) / cfg.warmup_updates
        self.step_update(0)

    def lr_at(self, num_updates: int) -> float:
        cfg = self.cfg
        if num_updates < cfg.warmup_updates:
            return self.warmup_init_lr + num_updates * self.lr_step
        curr_updates = num_updates - cfg.warmup_updates
        if cfg.t_mult != 1:
            # Periods P, P*m, P*m**2, ...: period i starts after P * (1 - m**i) / (1 - m) updates.
            i = math.floor(math.log(1 - curr_updates / self.period * (1 - cfg.t_mult), cfg.t_mult))
            t_i = cfg.t_mult**i * self.period
            t_curr = curr_updates - (1 - cfg.t_mult**i) / (1 - cfg.t_mult) * self.period
        else:
            i = math.floor(curr_updates / self.period)
            t_i = self.period
            t_curr = curr_updates - self.period * i
        shrink = cfg.lr_shrink**i
        min_lr, max_lr = cfg.min_lr * shrink, cfg.lr * shrink
        return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * t_curr / t_i))
