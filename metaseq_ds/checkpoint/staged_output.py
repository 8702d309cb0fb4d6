"""All-or-nothing output folders: a command writes into a hidden sibling and renames it at the end.

A failed or interrupted conversion leaves OUT as it was (absent or empty), never half-written.
"""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from metaseq_ds.errors import UsageError


def check_free(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UsageError(f"OUT {out} already exists and is not empty; choose a new directory")


@contextmanager
def staged_output(out: Path) -> Iterator[Path]:
    check_free(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
