"""`BaseLRScheduler` (fairseq's FairseqLRScheduler): sets the optimizer's lr from the update count.

A schedule is a pure function of the update number, so a resumed run only needs
`num_updates` to continue it; `state_dict` keeps the best validation loss.
"""

from metaseq_ds.optim.base_optimizer import BaseOptimizer


class BaseLRScheduler:
    def __init__(self, cfg, optimizer: BaseOptimizer):
        if not isinstance(optimizer, BaseOptimizer):
            raise ValueError(f"optimizer must be a BaseOptimizer, got {type(optimizer).__name__}")
        self.cfg = cfg
        self.optimizer = optimizer
        self.best = None

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state_dict):
        self.best = state_dict["best"]

    def step_begin_epoch(self, epoch: int) -> float:
        """Called at the start of each epoch; the built-in schedules depend on updates only."""
        return self.optimizer.get_lr()

    def step(self, epoch: int, val_loss=None) -> float:
        """Called at the end of each epoch with its validation loss; remembers the best."""
        if val_loss is not None:
            self.best = val_loss if self.best is None else min(self.best, val_loss)
        return self.optimizer.get_lr()

    def step_update(self, num_updates: int) -> float:
        """Called after every update: set the lr for the next update and return it."""
        lr = self.lr_at(num_updates)
        self.optimizer.set_lr(lr)
        return lr

    def lr_at(self, num_updates: int) -> float:
        """The schedule: the learning rate after `num_updates` updates (default: unchanged)."""
        return self.optimizer.get_lr()
