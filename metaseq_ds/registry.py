"""Name -> class registries for models, tasks, criterions, optimizers and LR schedulers.

Built-ins register when their package is imported (each package imports its modules
explicitly; nothing scans a directory). User plugins call the same `register_*` decorators,
typically from a module passed with `--user-dir`.
"""

import dataclasses
import difflib
from typing import Callable, Dict, Generic, Optional, Type, TypeVar

from metaseq_ds.errors import UsageError

T = TypeVar("T")


def closest(name: str, choices) -> str:
    """A '; did you mean X?' suffix for error messages, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


@dataclasses.dataclass
class Entry(Generic[T]):
    cls: Type[T]
    dataclass: Optional[type]


class Registry(Generic[T]):
    """One kind of pluggable component, chosen on the command line by `flag`."""

    def __init__(self, kind: str, flag: str, base: Optional[type] = None):
        self.kind = kind
        self.flag = flag
        self.base = base
        self.entries: Dict[str, Entry[T]] = {}

    def register(self, name: str, dataclass: Optional[type] = None) -> Callable[[Type[T]], Type[T]]:
        def decorate(cls: Type[T]) -> Type[T]:
            if name in self.entries:
                raise ValueError(f"cannot register duplicate {self.kind} ({name})")
            if self.base is not None and not issubclass(cls, self.base):
                raise ValueError(f"{self.kind} ({name}: {cls.__name__}) must extend {self.base.__name__}")
            config_cls = dataclass
            if config_cls is not None and config_cls.__dict__.get("_name") not in (None, name):
                # fairseq code registers one config class for several components; each needs
                # its own `_name` (it selects the component when a config is reloaded).
                config_cls = dataclasses.dataclass(type(config_cls.__name__, (config_cls,), {}))
            if config_cls is not None:
                config_cls._name = name
            setattr(cls, "__dataclass", config_cls)  # fairseq plugins read `cls.__dataclass`
            self.entries[name] = Entry(cls, config_cls)
            return cls

        return decorate

    def get(self, name: str) -> Entry[T]:
        if name not in self.entries:
            raise UsageError(
                f"{self.flag}: unknown {self.kind} {name!r}{closest(name, self.entries)} "
                f"(choose from {', '.join(sorted(self.entries))})"
            )
        return self.entries[name]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def choices(self):
        return sorted(self.entries)
