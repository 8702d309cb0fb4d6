"""The import hook behind `compat.install()`: `import fairseq.x` / `metaseq.x` -> metaseq_ds.

Each old module becomes an alias module whose attribute reads go to its metaseq_ds module
(paths from `metaseq_ds.renames`: `fairseq.models.fairseq_decoder` -> `metaseq_ds.models`,
`fairseq_cli.train` -> `metaseq_ds.cli.train`, ...), and whose old class names
(`FairseqDecoder`) return the new classes themselves, with a DeprecationWarning. The metaseq_ds
modules are not modified, so code that never installs the hook sees no old names.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

from metaseq_ds.renames import class_rename, is_old_module, new_module_path

MIGRATE_HINT = "`mseq migrate PATH` rewrites the imports"


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} is deprecated: use {new} ({MIGRATE_HINT})", DeprecationWarning, stacklevel=stacklevel)


class AliasModule(types.ModuleType):
    """An old module name standing for a metaseq_ds module."""

    def __init__(self, name: str, target: str):
        super().__init__(name)
        self.__compat_target__ = target

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__") and attr not in ("__file__", "__version__", "__all__"):
            raise AttributeError(attr)
        rename = class_rename(attr)
        if rename is not None:
            warn_renamed(f"{self.__name__}.{attr}", rename.new)
            return getattr(importlib.import_module(rename.new_module), rename.new_name)
        target = importlib.import_module(self.__compat_target__)
        try:
            return getattr(target, attr)
        except AttributeError:
            raise AttributeError(
                f"module {self.__name__!r} (compat alias of {self.__compat_target__}) has no attribute {attr!r}; "
                "see docs/migration.md"
            ) from None

    def __dir__(self):
        return sorted(set(dir(importlib.import_module(self.__compat_target__))))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return AliasModule(spec.name, self.target)

    def exec_module(self, module) -> None:
        importlib.import_module(self.target)  # import errors of the target surface at the old import


class CompatFinder(importlib.abc.MetaPathFinder):
    """Finds `fairseq`, `fairseq_cli`, `metaseq`, `metaseq_cli` and their submodules."""

    def find_spec(self, fullname, path=None, target=None):
        if not is_old_module(fullname):
            return None
        new, _ = new_module_path(fullname)
        try:
            spec = importlib.util.find_spec(new)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: compat maps it to {new}, which metaseq_ds does not have "
                "(docs/migration.md says what to use instead)",
                name=fullname,
            )
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(new), is_package=spec.submodule_search_locations is not None
        )


def aliases_in(modules) -> list:
    return [name for name, module in modules.items() if isinstance(module, AliasModule)]


def remove_aliases() -> None:
    for name in aliases_in(sys.modules):
        del sys.modules[name]
