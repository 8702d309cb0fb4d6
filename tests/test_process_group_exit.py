"""A process that started its process group through `distributed.utils.init_distributed`
destroys it when it exits cleanly (gloo's worker threads left to the interpreter's finalisation
can abort a run that succeeded), and leaves it alone after an uncaught exception (a rank that
failed mid-collective could block in the teardown).

Each case runs in a child process: a world of one on gloo."""

import subprocess
import sys

import pytest

from launch import env

CHILD = """
import atexit, sys
import torch.distributed as dist
from metaseq_ds.distributed import utils as dist_utils

# registered first, so it runs after init_distributed's handler (atexit runs them in reverse)
atexit.register(lambda: print("process group at exit:", "alive" if dist.is_initialized() else "destroyed", flush=True))
dist_utils.init_distributed()
dist_utils.barrier()
if sys.argv[1] == "fail":
    raise RuntimeError("a rank's failure")
"""


@pytest.mark.parametrize("ending, code, group", [("clean", 0, "destroyed"), ("fail", 1, "alive")])
def test_the_process_group_is_destroyed_at_a_clean_exit_only(ending, code, group):
    out = subprocess.run([sys.executable, "-c", CHILD, ending], capture_output=True, text=True, env=env(), timeout=120)
    assert out.returncode == code, out.stderr[-2000:]
    assert f"process group at exit: {group}" in out.stdout
