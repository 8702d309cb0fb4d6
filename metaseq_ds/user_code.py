"""The user's code: `--user-dir` plugin packages, and the opt-in `compat` hook for plugins that
`import fairseq` / `import metaseq` and cannot be edited.

`compat` is a sibling package of the same distribution. metaseq_ds imports it by name, and only
when `METASEQ_DS_COMPAT` asks for it, so the framework does not depend on its shims.
"""

import importlib
import importlib.util
import os
import sys
from pathlib import Path

from metaseq_ds.errors import UsageError

COMPAT_ENV_VAR = "METASEQ_DS_COMPAT"


def install_compat_if_asked() -> None:
    """`compat.install_from_env()` when METASEQ_DS_COMPAT is set (under `mseq` or any launcher)."""
    if os.environ.get(COMPAT_ENV_VAR):
        importlib.import_module("compat").install_from_env()


def import_user_module(user_dir: str) -> None:
    """Import a plugin package by path, explicitly (no sys.path edits, no scanning)."""
    path = Path(user_dir).resolve()
    init = path / "__init__.py" if path.is_dir() else path
    if not init.is_file():
        raise UsageError(f"--user-dir: {user_dir} is neither a package directory nor a .py file")
    name = path.stem
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(path)] if path.is_dir() else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
