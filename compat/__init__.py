"""Old names for code written against fairseq or metaseq.

    from compat import FairseqDecoder        # the very class metaseq_ds.models.BaseDecoder
    import compat; compat.install()          # then `import fairseq.models`, `from fairseq.tasks
                                             # import FairseqTask`, `import fairseq_cli.train`,
                                             # `import metaseq.models` resolve to metaseq_ds

For code you cannot edit (a `--user-dir` plugin, a script): `METASEQ_DS_COMPAT=1 mseq train ...`
installs the hook in `mseq`, and `python -m compat script.py ARGS` (or `-m module ARGS`) runs a
script with it. `METASEQ_DS_COMPAT=force` also shadows a real fairseq/metaseq installation.

Every old name warns (DeprecationWarning) with its new name; `mseq migrate` rewrites the code
for good. The names come from the one rename table, `metaseq_ds.renames`. Nothing here
imports torch until an old name is used.
"""

import importlib
import importlib.util
import os
import sys
from typing import List

from metaseq_ds.errors import UsageError
from metaseq_ds.renames import CLASS_RENAMES, OLD_PACKAGES, class_rename

from compat.hook import AliasModule, CompatFinder, remove_aliases, warn_renamed

ENV_VAR = "METASEQ_DS_COMPAT"

__all__ = ["ENV_VAR", "install", "install_from_env", "installed", "uninstall"]


def __getattr__(name: str):
    rename = class_rename(name)
    if rename is None:
        raise AttributeError(f"module 'compat' has no attribute {name!r}")
    warn_renamed(f"compat.{name}", rename.new)
    return getattr(importlib.import_module(rename.new_module), rename.new_name)


def __dir__() -> List[str]:
    return sorted(set(__all__) | {r.old_name for r in CLASS_RENAMES})


def installed() -> bool:
    return any(isinstance(finder, CompatFinder) for finder in sys.meta_path)


def real_packages() -> List[str]:
    """The old packages that exist for real on this Python path (as `name (location)`)."""
    found = []
    for name in OLD_PACKAGES:
        module = sys.modules.get(name)
        if module is not None and not isinstance(module, AliasModule):
            found.append(f"{name} ({getattr(module, '__file__', None) or 'loaded'})")
            continue
        if module is None and not installed():
            spec = importlib.util.find_spec(name)
            if spec is not None:
                found.append(f"{name} ({spec.origin or list(spec.submodule_search_locations or [])})")
    return found


def install(force: bool = False) -> None:
    """Make `import fairseq...`, `fairseq_cli...`, `metaseq...`, `metaseq_cli...` resolve to metaseq_ds.

    Refuses (UsageError) when a real one of those packages is installed, since its users would
    silently get metaseq_ds instead; `force=True` shadows it anyway. Calling it twice is harmless.
    """
    if installed():
        return
    real = real_packages()
    if real and not force:
        raise UsageError(
            f"compat.install() would shadow the installed {', '.join(real)}: uninstall it, or call "
            f"compat.install(force=True) / set {ENV_VAR}=force to have metaseq_ds answer those imports anyway"
        )
    for name in OLD_PACKAGES:  # a real package already imported would keep answering its submodules
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            if not isinstance(sys.modules[loaded], AliasModule):
                del sys.modules[loaded]
    sys.meta_path.insert(0, CompatFinder())


def uninstall() -> None:
    """Remove the hook and forget the alias modules it made."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, CompatFinder)]
    remove_aliases()


def install_from_env() -> bool:
    """Install the hook when METASEQ_DS_COMPAT is set (`1`, or `force`); return whether it did."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    install(force=value == "force")
    return True
