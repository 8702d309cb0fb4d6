"""Where an old dotted name lives in the installed metaseq_ds, found without importing it.

    index = ModuleIndex()
    index.translate("fairseq.models.fairseq_decoder.FairseqDecoder")
    # Translation(module='metaseq_ds.models', attr='BaseDecoder', consumed=4, rename=ClassRename(...))

The rename table (`metaseq_ds.renames`) maps old modules to new paths; this module checks
that the result exists by reading metaseq_ds's source with `ast` (top-level definitions,
imports and assignments of each module), so `mseq migrate` and its worker processes start
without torch. `tests/test_renames.py` checks it against real imports.
"""

import ast
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import FrozenSet, List, Optional, Union

from metaseq_ds.renames import ClassRename, class_rename, new_module_path, not_provided


@dataclass(frozen=True)
class Translation:
    module: str  # the metaseq_ds module that holds the name (or is the target itself)
    attr: Optional[str]  # the name in `module`; None when the target is the module
    consumed: int  # how many leading parts of the old dotted name this covers (the rest are attributes of it)
    rename: Optional[ClassRename] = None

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


@dataclass(frozen=True)
class Unresolved:
    reason: str


class ModuleIndex:
    """The modules and top-level names of an installed package, read from its source files."""

    def __init__(self, package: str = "metaseq_ds"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(f"{package} is not installed")
        self.package = package
        self.root = Path(list(spec.submodule_search_locations)[0])

    def _file(self, module: str) -> Optional[Path]:
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        base = self.root.joinpath(*parts[1:])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
        return None

    def is_module(self, module: str) -> bool:
        return self._file(module) is not None

    def names(self, module: str) -> FrozenSet[str]:
        return _top_level_names(self._file(module))

    def has(self, module: str, name: str) -> bool:
        """Whether `module.name` exists: a submodule or a name bound at its top level."""
        return self.is_module(f"{module}.{name}") or name in self.names(module)

    def translate(self, old: str) -> Union[Translation, Unresolved]:
        """The metaseq_ds location of an old dotted name, or why there is none."""
        found = self._translate(old)
        left_out = not_provided(old) if isinstance(found, Unresolved) else None
        return Unresolved(f"not provided: {left_out}") if left_out else found

    def _translate(self, old: str) -> Union[Translation, Unresolved]:
        parts = old.split(".")
        moved, consumed = new_module_path(old)
        new_parts = moved.split(".")
        # `moved` = a listed module path + the old name's remaining parts, walked one at a time
        module_len = len(new_parts) - (len(parts) - consumed)
        current = ".".join(new_parts[:module_len])
        if not self.is_module(current):
            return Unresolved(f"{current} does not exist in metaseq_ds")
        for i in range(consumed, len(parts)):
            part = parts[i]
            rename = class_rename(part)
            if rename is not None:
                return Translation(rename.new_module, rename.new_name, i + 1, rename)
            if self.is_module(f"{current}.{part}"):
                current = f"{current}.{part}"
            elif part in self.names(current):
                return Translation(current, part, i + 1)
            else:
                return Unresolved(f"{current} has no {part!r}")
        return Translation(current, None, len(parts))


@lru_cache(maxsize=None)
def _top_level_names(path: Optional[Path]) -> FrozenSet[str]:
    if path is None:
        return frozenset()
    names: List[str] = []
    _collect(ast.parse(path.read_text(), str(path)).body, names)
    return frozenset(names)


def _collect(body, names: List[str]) -> None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.extend(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import):
            names.extend(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.extend(a.asname or a.name for a in node.names if a.name != "*")
        elif isinstance(node, (ast.If, ast.Try, ast.With)):  # conditional definitions still define the name
            for block in ("body", "orelse", "finalbody"):
                _collect(getattr(node, block, []), names)
            for handler in getattr(node, "handlers", []):
                _collect(handler.body, names)
