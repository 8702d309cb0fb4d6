"""`sgd`: SGD with momentum and decoupled weight decay (SGDW, arXiv:1711.05101), as metaseq's."""

from dataclasses import dataclass, field
from typing import Annotated

import torch
from pydantic import Field

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import NonNegativeFloat, PositiveFloat
from metaseq_ds.optim.base_optimizer import BaseOptimizer
from metaseq_ds.optim.registry import register_optimizer


@dataclass
class MetaseqSGDWConfig(MetaseqDataclass):
    momentum: Annotated[float, Field(ge=0, lt=1)] = field(default=0.0, metadata={"help": "momentum factor"})
    weight_decay: NonNegativeFloat = field(default=0.0, metadata={"help": "weight decay, decoupled from the gradient"})
    lr: PositiveFloat = field(default=0.25, metadata={"help": "same as --lr"})


@register_optimizer("sgd", dataclass=MetaseqSGDWConfig)
class MetaseqSGDW(BaseOptimizer):
    def __init__(self, cfg: MetaseqSGDWConfig, params):
        super().__init__(cfg)
        self._optimizer = SGDW(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        return {"lr": self.cfg.lr, "momentum": self.cfg.momentum, "weight_decay": self.cfg.weight_decay}


class SGDW(torch.optim.Optimizer):
    """buf = momentum * buf + grad (buf = grad on the first step); p -= lr * wd * p; p -= lr * buf.

    Unlike torch.optim.SGD, the decay does not pass through the momentum buffer.
    Half-precision parameters are updated in fp32 and copied back.
    """

    supports_memory_efficient_fp16 = True
    supports_flat_params = True

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0.0:
                raise ValueError(f"SGDW: {name} must be >= 0, got {value}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, weight_decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                update = p.grad.float()
                p_fp32 = p.float()  # p itself when p is fp32
                if momentum != 0:
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = update.clone()
                    else:
                        state["momentum_buffer"].mul_(momentum).add_(update)
                    update = state["momentum_buffer"]
                if weight_decay != 0:
                    p_fp32.mul_(1 - lr * weight_decay)
                p_fp32.add_(update, alpha=-lr)
                if p_fp32 is not p:
                    p.copy_(p_fp32)
        return loss
