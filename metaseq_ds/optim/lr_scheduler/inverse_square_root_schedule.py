"""`inverse_sqrt`: linear warmup to --lr, then decay proportional to 1/sqrt(update)."""

from dataclasses import dataclass, field

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.errors import UsageError
from metaseq_ds.optim.lr_scheduler import BaseLRScheduler, register_lr_scheduler


@dataclass
class InverseSquareRootLRScheduleConfig(MetaseqDataclass):
    warmup_updates: int = field(
        default=4000, metadata={"help": "warmup the learning rate linearly for the first N updates"}
    )
    warmup_init_lr: float = field(
        default=-1, metadata={"help": "initial learning rate during warmup phase; default is 0 (--lr without warmup)"}
    )
    lr: float = field(default=0.25, metadata={"help": "same as --lr"})


@register_lr_scheduler("inverse_sqrt", dataclass=InverseSquareRootLRScheduleConfig)
class InverseSquareRootSchedule(BaseLRScheduler):
    """t < W: init + t * (lr - init) / W;  t >= W: lr * sqrt(W / t)."""

    def __init__(self, cfg: InverseSquareRootLRScheduleConfig, optimizer):
        super().__init__(cfg, optimizer)
        if cfg.warmup_updates <= 0:
            raise UsageError(f"--warmup-updates must be > 0 for inverse_sqrt (got {cfg.warmup_updates})")
        self.warmup_init_lr = cfg.warmup_init_lr if cfg.warmup_init_lr >= 0 else 0.0
        self.lr_step = (cfg.lr - self.warmup_init_lr) / cfg.warmup_updates
        self.decay_factor = cfg.lr * cfg.warmup_updates**0.5
        self.step_update(0)

    def lr_at(self, num_updates: int) -> float:
        if num_updates < self.cfg.warmup_updates:
            return self.warmup_init_lr + num_updates * self.lr_step
        return self.decay_factor * num_updates**-0.5
