"""Every test runs in an empty working directory and HOME of its own (the subprocesses it starts too).

`mseq train`'s defaults are relative to the working directory (`--save-dir checkpoints`, the demo's
`data/demo_corpus`) and caches default to HOME: run from a checkout where the README's demo ran, a
test would resume or refuse the demo's checkpoints, and any test could write into the checkout or
the user's home. Module-scoped fixtures run before a test's own fixtures, so the session gets one
isolated directory and HOME first, then each test gets its own.

A command run in-process (typer's runner) fills in a one-rank rendezvous (RANK, MASTER_PORT, ...)
and opens a process group in the pytest process; both are undone after each test, or every later
subprocess would inherit RANK=0 and that MASTER_PORT and fail to listen on a port this process holds.

What must not move is pinned to its real location before HOME changes: DeepSpeed's JIT-built ops
(`TORCH_EXTENSIONS_DIR`, 54-113 s to rebuild) and the user site-packages (where a `pip install
--user` put this package for the subprocesses).

The suite runs in pytest-xdist workers (pyproject's `-n auto`): one a core, fewer where memory is
short, each with its share of the cores for torch's threads, in this process and in the ones it
starts, so that workers do not oversubscribe the CPU.
"""

import os
import site
from pathlib import Path

import pytest

# Unset, they fall back to HOME: a caller's values could point into the real home.
XDG_DIRS = ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")
# What metaseq_ds.distributed.utils.prepare_environment sets for a process no launcher started.
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "DS_ACCELERATOR")


# A worker's heaviest test (4 ranks under the launcher, test_tensor_parallel's tp2_dp2_zero3)
# peaks at 2.4 GiB with the worker itself (the resident memory of its processes, summed).
MEMORY_PER_WORKER = 4 << 30


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config) -> int:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(_cores(), memory // MEMORY_PER_WORKER))


def pytest_configure(config):
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers > 1:
        import torch

        # Set before any test runs: prepare_environment and torch in subprocesses read it.
        threads = max(1, _cores() // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _isolate(patch: pytest.MonkeyPatch, root: Path) -> None:
    (root / "home").mkdir()
    (root / "cwd").mkdir()
    patch.setenv("HOME", str(root / "home"))
    for name in XDG_DIRS:
        patch.delenv(name, raising=False)
    patch.chdir(root / "cwd")


@pytest.fixture(scope="session", autouse=True)
def _isolated_session(tmp_path_factory):
    from torch.utils.cpp_extension import get_default_build_root

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
        patch.setenv("PYTHONUSERBASE", site.getuserbase())
        _isolate(patch, tmp_path_factory.mktemp("session_env"))
        yield


@pytest.fixture(autouse=True)
def _isolated_test(tmp_path_factory, monkeypatch):
    _isolate(monkeypatch, tmp_path_factory.mktemp("test_env"))
    rendezvous = {name: os.environ.get(name) for name in RENDEZVOUS}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for name, value in rendezvous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
