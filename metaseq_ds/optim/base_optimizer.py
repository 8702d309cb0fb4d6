"""`BaseOptimizer` (fairseq's FairseqOptimizer): a thin owner of one torch optimizer.

The trainer builds one with `build_optimizer`, hands `optimizer.optimizer` (the torch
optimizer) to `deepspeed.initialize`, and may then point `.optimizer` at DeepSpeed's
wrapper. Everything here reads `.optimizer` afresh, so LR schedulers keep setting the lr
through `set_lr` whichever object it is (ZeRO wrappers share `param_groups` with the
torch optimizer they wrap).
"""

import torch

from metaseq_ds import utils


class BaseOptimizer:
    """Base of every registered optimizer; subclasses set `self._optimizer` in `__init__`."""

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def check_kernels(cls, cfg) -> None:
        """Before a run writes anything: build or load what `cfg` needs that could fail (a JIT
        kernel), raising `UsageError` if it cannot. Nothing to do for torch's own optimizers."""

    @property
    def optimizer(self):
        """The torch optimizer (or the DeepSpeed optimizer that replaced it)."""
        if not hasattr(self, "_optimizer"):
            raise NotImplementedError(f"{type(self).__name__}.__init__ must set self._optimizer")
        return self._optimizer

    @optimizer.setter
    def optimizer(self, optimizer):
        self._optimizer = optimizer

    @property
    def optimizer_config(self):
        """Keyword arguments of the torch optimizer that a restored checkpoint must not override
        (lr, betas, ...), so a run can resume with new optimizer flags."""
        raise NotImplementedError(f"{type(self).__name__} must define optimizer_config")

    @property
    def params(self):
        for param_group in self.param_groups:
            yield from param_group["params"]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_lr(self) -> float:
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        for param_group in self.param_groups:
            param_group["lr"] = lr

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        """Load optimizer state; `optimizer_overrides` (usually `optimizer_config`) then replace
        the hyperparameters saved in it, so the current flags win over the checkpoint's."""
        self.optimizer.load_state_dict(state_dict)
        if optimizer_overrides:
            for group in self.param_groups:
                group.update(optimizer_overrides)

    def backward(self, loss):
        loss.backward()

    def multiply_grads(self, c):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(c.to(p.grad.device) if torch.is_tensor(c) else c)

    def clip_grad_norm(self, max_norm: float, norm_type: str = "l2", aggregate_norm_fn=None):
        """Clip the gradient norm to `max_norm` (0: only measure it); return the norm before clipping."""
        return utils.clip_grad_norm_(self.params, max_norm, norm_type, aggregate_norm_fn)

    def step(self, closure=None, scale: float = 1.0):
        """One optimizer step; gradients are divided by `scale` first (metaseq's loss scale)."""
        if scale != 1.0:
            self.multiply_grads(1.0 / scale)
        self.optimizer.step(closure)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        """Whether the torch optimizer can step fp16 parameters itself (metaseq's question)."""
        return getattr(self.optimizer, "supports_memory_efficient_fp16", False)

    @property
    def supports_flat_params(self) -> bool:
        """Whether the torch optimizer works on parameters flattened into one tensor."""
        return getattr(self.optimizer, "supports_flat_params", False)


class LegacyOptimizer(BaseOptimizer):
    """An optimizer configured from an argparse namespace (`args`), as fairseq plugins wrote them."""

    def __init__(self, args):
        super().__init__(args)
        self.args = args
