"""`StatefulContainer`: the part of a task that checkpoints keep (metaseq's and fairseq's `task.state`).

A task registers how to build each piece of its state, and builds it on first use:

    self.state.add_factory("dictionary", self.load_dictionary)
    self.state.dictionary  # load_dictionary() runs now, once

The trainer saves `task.state_dict()` with each checkpoint (as `task_state`, metaseq's key) and a
resumed run merges it back before training, so a piece built before the save is the saved one,
not built again. Checkpoints are read with `torch.load(weights_only=True)`: the state holds plain
data (tensors, numbers, strings, bytes, None, and lists, tuples, sets and dicts of them) and
`Dictionary` objects; `checkpointable` names a piece that is neither, at save time rather than
when a resumed run fails to read it.
"""

from collections import Counter, OrderedDict
from typing import Any, Callable, Dict

import torch

from metaseq_ds.data.dictionary import Dictionary
from metaseq_ds.errors import UsageError

# What torch's weights-only unpickler reads (checked by type, not isinstance: a subclass such as
# numpy's float64 is refused by it), besides tensors; `Dictionary` is allowed by our loader.
PLAIN_TYPES = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, Dictionary)
MAPPING_TYPES = (dict, OrderedDict, Counter)
COLLECTION_TYPES = (list, tuple, set)


class StatefulContainer:
    """Named pieces of task state, each built by its factory on first access."""

    def __init__(self):
        # Per instance: metaseq's class-level dicts made every task share one state.
        self._state: Dict[str, Any] = {}
        self._factories: Dict[str, Callable[[], Any]] = {}

    def add_factory(self, name: str, factory: Callable[[], Any]) -> None:
        self._factories[name] = factory

    def merge_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._state.update(state_dict)

    @property
    def state_dict(self) -> Dict[str, Any]:
        """The pieces built (or merged) so far, by name (a property, as in metaseq)."""
        return self._state

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not state: private names, and copy/pickle probing an unset instance
            raise AttributeError(name)
        if name not in self._state and name in self._factories:
            self._state[name] = self._factories[name]()
        if name in self._state:
            return self._state[name]
        raise AttributeError(f"Task state has no factory for attribute {name}")


def checkpointable(state: Dict[str, Any], where: str = "task state") -> None:
    """Raise a UsageError naming the first piece of `state` a weights-only load would refuse."""
    for key, value in state.items():
        path = f"{where}[{key!r}]"
        if type(value) in MAPPING_TYPES:
            checkpointable(value, path)
        elif type(value) in COLLECTION_TYPES:
            checkpointable(dict(enumerate(value)), path)
        elif not isinstance(value, torch.Tensor) and type(value) not in PLAIN_TYPES:
            raise UsageError(
                f"{path} is a {type(value).__name__}: checkpoints load with weights_only=True, so task state holds "
                "tensors, numbers, strings, None, Dictionary objects and lists, tuples, sets or dicts of them; "
                "keep the data the object is built from")
