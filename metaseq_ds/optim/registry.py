"""The `--optimizer` registry. Re-exported by `metaseq_ds.optim`."""

from typing import Iterable

from metaseq_ds.optim.base_optimizer import BaseOptimizer
from metaseq_ds.registry import Registry

OPTIMIZER_REGISTRY = Registry("optimizer", "--optimizer", base=BaseOptimizer)
register_optimizer = OPTIMIZER_REGISTRY.register


def build_optimizer(optimizer_cfg, params: Iterable) -> BaseOptimizer:
    """Build the optimizer named by `optimizer_cfg._name` over the trainable `params`.

    `params` are tensors or torch param-group dicts (`{"params": [...], "weight_decay": 0.0}`);
    frozen tensors (requires_grad False) are left out either way.
    """
    params = list(params)
    if params and all(isinstance(p, dict) for p in params):
        params = [{**group, "params": _trainable(group["params"])} for group in params]
    else:
        params = _trainable(params)
    entry = OPTIMIZER_REGISTRY.get(optimizer_cfg._name)
    return entry.cls(optimizer_cfg, params)


def check_optimizer_kernels(optimizer_cfg) -> None:
    """Build what the chosen optimizer compiles on first use, before a run writes anything."""
    OPTIMIZER_REGISTRY.get(optimizer_cfg._name).cls.check_kernels(optimizer_cfg)


def _trainable(params):
    return [p for p in params if p.requires_grad]
