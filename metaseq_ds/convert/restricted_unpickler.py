"""Read old fairseq/metaseq `.pt` files without importing (or running) fairseq, metaseq or omegaconf.

    state, stand_ins = load_legacy_checkpoint(path)

`torch.load(weights_only=True)` is tried first. Files that pickled classes of those
packages (an OmegaConf `cfg`, fairseq's enums, an argparse `args`) are read again with an
unpickler that accepts torch's weights-only allow-list, numpy scalars and
`argparse.Namespace`, and turns every fairseq/metaseq/omegaconf class into a stand-in that
only records its data; `plain()` then reduces those to dicts, lists and values. Any other
class is refused: loading a checkpoint must never execute code it names.
"""

import _compat_pickle
import argparse
import copyreg
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Set, Tuple

import torch

from metaseq_ds.errors import UsageError

# typing appears inside OmegaConf's metadata (ref_type=typing.Any): recorded, never needed.
STAND_IN_PACKAGES = ("fairseq", "fairseq_cli", "metaseq", "metaseq_cli", "omegaconf", "typing")
EXTRA_ALLOWED = {
    "argparse.Namespace": argparse.Namespace,
    "copyreg._reconstructor": copyreg._reconstructor,
    "builtins.object": object,
    "builtins.frozenset": frozenset,
    "builtins.slice": slice,
    "collections.defaultdict": __import__("collections").defaultdict,
    **{f"builtins.{t.__name__}": t for t in (dict, list, tuple, str, int, float, bool, type(None))},
}


class StandIn:
    """An object of a class we refuse to import: its constructor args, state and items."""

    _qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj._args, obj._state, obj._items, obj._list = args, None, {}, []
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self._state = state

    def __setitem__(self, key, value):
        self._items[key] = value

    def append(self, value):
        self._list.append(value)

    def extend(self, values):
        self._list.extend(values)


def _allowed_globals() -> Dict[str, Any]:
    from metaseq_ds.private_apis.torch_ops import weights_only_allowed_globals

    allowed = weights_only_allowed_globals()
    allowed.update(EXTRA_ALLOWED)
    try:  # numpy scalars and arrays (fairseq stored e.g. the best loss as numpy.float64)
        import numpy

        core = numpy._core if hasattr(numpy, "_core") else numpy.core
        for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
            allowed[f"{module}.scalar"] = core.multiarray.scalar
            allowed[f"{module}._reconstruct"] = core.multiarray._reconstruct
        allowed["numpy.dtype"] = numpy.dtype
        allowed["numpy.ndarray"] = numpy.ndarray
    except ImportError:
        pass
    return allowed


def _restricted_pickle_module(stand_ins: Set[str]) -> types.ModuleType:
    allowed = _allowed_globals()
    classes: Dict[str, type] = {}

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            # Protocol-2 pickles (torch.save's) spell builtins the Python 2 way: __builtin__.long.
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
            qualified = f"{module}.{name}"
            if qualified in allowed:
                return allowed[qualified]
            if module.startswith("numpy.dtypes"):  # numpy 2's per-dtype classes
                import numpy

                return getattr(numpy.dtypes, name)
            if module.split(".")[0] in STAND_IN_PACKAGES:
                stand_ins.add(qualified)
                if qualified not in classes:
                    classes[qualified] = type(name, (StandIn,), {"_qualified_name": qualified})
                return classes[qualified]
            raise pickle.UnpicklingError(f"needs class {qualified}, which is neither data nor a fairseq/metaseq/omegaconf class")

    module = types.ModuleType("restricted_pickle")
    module.Unpickler = Unpickler
    module.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()
    module.__name__ = "restricted_pickle"
    return module


def load_legacy_checkpoint(path: Path) -> Tuple[Any, List[str]]:
    """The file's object (tensors memory-mapped when the format allows) and the stand-in classes used."""
    mmap = zipfile.is_zipfile(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap), []
    except pickle.UnpicklingError:
        pass  # a class outside torch's allow-list: read again below, without importing it
    except Exception as error:
        raise _unreadable(path, error) from None
    stand_ins: Set[str] = set()
    pickle_module = _restricted_pickle_module(stand_ins)  # outside the try: its version gate's line stays its own
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap, pickle_module=pickle_module)
    except pickle.UnpicklingError as error:
        raise UsageError(f"{path}: {error}; refusing to load it") from None
    except Exception as error:
        raise _unreadable(path, error) from None
    return state, sorted(stand_ins)


def _unreadable(path: Path, error: Exception) -> UsageError:
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return UsageError(f"{path}: cannot read (truncated, or not a torch checkpoint): {first}")


def plain(value: Any) -> Any:
    """Stand-ins, Namespaces and OmegaConf nodes -> dicts, lists and plain values, recursively."""
    if isinstance(value, StandIn):
        state = value._state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (__dict__, slots) form
        if isinstance(state, dict) and "_content" in state:  # OmegaConf DictConfig / ListConfig
            return plain(state["_content"])
        if isinstance(state, dict) and "_val" in state:  # OmegaConf value node
            return plain(state["_val"])
        if value._items:
            return {k: plain(v) for k, v in value._items.items()}
        if value._list:
            return [plain(v) for v in value._list]
        if value._args and state is None:  # an enum or other value type: its value
            return plain(value._args[0]) if len(value._args) == 1 else [plain(a) for a in value._args]
        return plain(state) if state is not None else None
    if isinstance(value, argparse.Namespace):
        return {k: plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
