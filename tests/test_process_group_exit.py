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

from launch import TINY, env, free_port, write_corpus

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
from pathlib import Path

def distributed_threads():
    names = (Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    return sorted(name for name in names if "gloo" in name or "tcpstore" in name)

# registered first, so it runs after init_distributed's handler (atexit runs them in reverse)
atexit.register(lambda: print("distributed threads at exit:", distributed_threads(), flush=True))
sys.path.insert(0, sys.argv[1])
from launch import tiny_zero_engine, tiny_zero_step

def train(stage):
    engine = tiny_zero_engine({"stage": stage})
    return [tiny_zero_step(engine, step) for step in range(2)]

if sys.argv[2] == "mseq train":
    from metaseq_ds.cli.train import cli_main
    cli_main(sys.argv[3:])
else:
    train(int(sys.argv[2]))
    print("distributed threads before exit:", distributed_threads(), flush=True)
"""


@pytest.mark.parametrize("job, ranks", [("0", 1), ("1", 1), ("2", 1), ("3", 1), ("mseq train", 1), ("mseq train", 2)],
                         ids=["zero0", "zero1", "zero2", "zero3", "mseq_train_zero3", "mseq_train_two_ranks"])
def test_every_process_group_is_freed_before_the_interpreter_finalises(job, ranks, tmp_path):
    """ZeRO-1/2/3 engines stay alive through their hooks, ZeRO-3's through DeepSpeed's module
    stack and coordinator cache, and torch.distributed.nn's defaults would hold the default group:
    the exit handler frees them all while the interpreter runs, in one process and under the
    deepspeed launcher (ZeRO-3 on 2 ranks, its streamed tied embedding)."""
    child = tmp_path / "child.py"
    child.write_text(THREADS_AT_EXIT)
    args = []
    if job == "mseq train":
        args = [str(write_corpus(tmp_path / "corpus")), *TINY, "--zero-stage", "3", "--max-update", "2",
                "--save-dir", str(tmp_path / "ckpt")]
    launcher = [] if ranks == 1 else ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--no_local_rank",
                                      "--master_port", str(free_port())]
    out = subprocess.run([sys.executable, *launcher, str(child), str(Path(__file__).parent), job, *args],
                         capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if job != "mseq train":
        assert "distributed threads before exit: ['gloo_tcp_loop'" in out.stdout  # the groups were running
    else:
        assert "train_inner" in out.stdout
    assert out.stdout.count("distributed threads at exit: []") == ranks, out.stdout[-2000:]
