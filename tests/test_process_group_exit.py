"""A process that started its process group through `distributed.utils.init_distributed`
destroys it when it exits cleanly (gloo's worker threads left to the interpreter's finalisation
can abort a run that succeeded), and leaves it alone after an uncaught exception (a rank that
failed mid-collective could block in the teardown). At a clean exit every group is freed, and
its threads stopped, before the interpreter finalises, though DeepSpeed engines and DeepSpeed
itself held them.

Each case runs in a child process: a world of one on gloo."""

import subprocess
import sys
from pathlib import Path

import pytest

from launch import TINY, env, write_corpus

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


THREADS_AT_EXIT = """
import atexit, os, sys

def distributed_threads():
    names = (Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name or "tcpstore" in name)

from pathlib import Path
# registered first, so it runs after init_distributed's handler (atexit runs them in reverse)
atexit.register(lambda: print("distributed threads at exit:", distributed_threads(), flush=True))
sys.path.insert(0, sys.argv[1])
from launch import tiny_zero_engine, tiny_zero_step

def train(stage):
    engine = tiny_zero_engine({"stage": stage})
    return [tiny_zero_step(engine, step) for step in range(2)]

if sys.argv[2] == "mseq train":
    from metaseq_ds.cli.main import app
    app(sys.argv[3:])
else:
    train(int(sys.argv[2]))
    print("distributed threads before exit:", distributed_threads(), flush=True)
"""


@pytest.mark.parametrize("job", ["0", "1", "2", "3", "mseq train"],
                         ids=["zero0", "zero1", "zero2", "zero3", "mseq_train_zero3"])
def test_every_process_group_is_freed_before_the_interpreter_finalises(job, tmp_path):
    """ZeRO-1/2/3 engines stay alive through their hooks, ZeRO-3's through DeepSpeed's module
    stack and coordinator cache, and torch.distributed.nn's defaults would hold the default group:
    the exit handler frees them all while the interpreter runs."""
    args = []
    if job == "mseq train":
        args = ["train", str(write_corpus(tmp_path / "corpus")), *TINY, "--zero-stage", "3", "--max-update", "2",
                "--save-dir", str(tmp_path / "ckpt")]
    out = subprocess.run([sys.executable, "-c", THREADS_AT_EXIT, str(Path(__file__).parent), job, *args],
                         capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if job != "mseq train":
        assert "distributed threads before exit: ['gloo_tcp_loop'" in out.stdout  # the groups were running
    assert "distributed threads at exit: []" in out.stdout, out.stdout[-2000:]
