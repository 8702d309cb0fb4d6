"""`polynomial_decay`: linear warmup, then polynomial decay to --end-learning-rate (OPT's schedule)."""

from dataclasses import dataclass, field
from typing import Optional

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from metaseq_ds.errors import UsageError
from metaseq_ds.optim.lr_scheduler.base_lr_scheduler import BaseLRScheduler
from metaseq_ds.optim.lr_scheduler.registry import register_lr_scheduler


@dataclass
class PolynomialDecayLRScheduleConfig(MetaseqDataclass):
    warmup_updates: NonNegativeInt = field(
        default=0, metadata={"help": "warmup the learning rate linearly for the first N updates"}
    )
    end_learning_rate: NonNegativeFloat = field(default=0.0, metadata={"help": "learning rate to decay to"})
    zero_lr_warmup_steps: NonNegativeInt = field(
        default=0,
        metadata={"help": "number of steps to run with lr = 0 in the beginning, before warmup_updates, to update EMAs"},
    )
    power: PositiveFloat = field(default=1.0, metadata={"help": "decay exponent"})
    total_num_update: Optional[PositiveInt] = field(
        default=None, metadata={"help": "total number of updates over which to decay learning rate (default: --max-update)"}
    )
    lr: PositiveFloat = field(default=0.25, metadata={"help": "same as --lr"})


@register_lr_scheduler("polynomial_decay", dataclass=PolynomialDecayLRScheduleConfig)
class PolynomialDecayLRSchedule(BaseLRScheduler):
    """With Z zero-lr steps, W warmup updates and T total updates (metaseq's edges):

    t <= Z: 0;  t <= Z + W: (t - Z) / W * lr;  t >= T: end;
    else: (lr - end) * (1 - (t - Z - W) / (T - Z - W)) ** power + end.
    """

    def __init__(self, cfg: PolynomialDecayLRScheduleConfig, optimizer):
        super().__init__(cfg, optimizer)
        if cfg.total_num_update is None:  # `mseq train` derives it from --max-update; a script must give it
            raise UsageError("polynomial_decay needs --total-num-update (or --max-update)")
        self.step_update(0)

    def lr_at(self, num_updates: int) -> float:
        cfg = self.cfg
        warmup_end = cfg.zero_lr_warmup_steps + cfg.warmup_updates
        if cfg.zero_lr_warmup_steps > 0 and num_updates <= cfg.zero_lr_warmup_steps:
            return 0.0
        if cfg.warmup_updates > 0 and num_updates <= warmup_end:
            return (num_updates - cfg.zero_lr_warmup_steps) / cfg.warmup_updates * cfg.lr
        if num_updates >= cfg.total_num_update:
            return cfg.end_learning_rate
        pct_remaining = 1 - (num_updates - warmup_end) / (cfg.total_num_update - warmup_end)
        return (cfg.lr - cfg.end_learning_rate) * pct_remaining**cfg.power + cfg.end_learning_rate
