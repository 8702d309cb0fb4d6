"""The `--arch` registries: models by name, architectures (functions of an `args` namespace that
fill defaults), and building the model a config names. Re-exported by `metaseq_ds.models`."""

import types
from typing import Any, Callable, Dict, Mapping

from metaseq_ds.errors import UsageError
from metaseq_ds.models.base import BaseModel
from metaseq_ds.registry import Registry, closest

MODEL_REGISTRY = Registry("model", "--arch", base=BaseModel)
ARCH_MODEL_REGISTRY: Dict[str, str] = {}  # arch name -> model name
ARCH_CONFIG_REGISTRY: Dict[str, Callable[[Any], None]] = {}  # arch name -> fn(args) setting defaults


def register_model(name: str, dataclass=None):
    """Class decorator: register a `BaseModel` subclass as `name` (and, given a config, `--arch name`)."""
    register_cls = MODEL_REGISTRY.register(name, dataclass)

    def decorate(cls):
        register_cls(cls)
        if dataclass is not None:  # as metaseq: the model name is also an arch with the config's own defaults
            register_model_architecture(name, name)(_no_defaults)
        return cls

    return decorate


def _no_defaults(args) -> None:
    """The architecture named after its model: the config dataclass's defaults apply as they are."""


def register_model_architecture(model_name: str, arch_name: str):
    """Function decorator: `fn(args)` sets the defaults of `--arch arch_name` on a namespace."""

    def decorate(fn: Callable[[Any], None]) -> Callable[[Any], None]:
        if model_name not in MODEL_REGISTRY:
            raise ValueError(f"cannot register architecture {arch_name} for unknown model {model_name}")
        if arch_name in ARCH_MODEL_REGISTRY:
            raise ValueError(f"cannot register duplicate architecture ({arch_name})")
        if not callable(fn):
            raise ValueError(f"architecture {arch_name} must be a function of args")
        ARCH_MODEL_REGISTRY[arch_name] = model_name
        ARCH_CONFIG_REGISTRY[arch_name] = fn
        return fn

    return decorate


def arch_defaults(arch_name: str, explicitly_set: Mapping[str, Any]) -> Dict[str, Any]:
    """The values after `--arch arch_name` filled its defaults around those set explicitly: every
    attribute the architecture's function left on the namespace, config field or not."""
    if arch_name not in ARCH_CONFIG_REGISTRY:
        raise UsageError(
            f"--arch: unknown architecture {arch_name!r}{closest(arch_name, ARCH_CONFIG_REGISTRY)} "
            f"(choose from {', '.join(sorted(ARCH_CONFIG_REGISTRY))})"
        )
    args = types.SimpleNamespace(**explicitly_set)
    ARCH_CONFIG_REGISTRY[arch_name](args)
    return vars(args)


def build_model(model_cfg, task) -> BaseModel:
    """Build the model named by `model_cfg._name` (set when its config class was registered)."""
    return MODEL_REGISTRY.get(model_cfg._name).cls.build_model(model_cfg, task)
