"""A launch leaves /dev/shm as it found it: DeepSpeed's CPU all-reduce buffers (~66 MB a rank,
named after the launch's port) are gone after a normal 2-rank run, a usage error raised after the
ranks started, and Ctrl-C. (Every launch through `launch.run` checks it too.)"""

import os
import signal
import subprocess
import sys
import time

import pytest

from launch import TINY, env, free_port, run, shm_leftovers, write_corpus


@pytest.mark.slow
def test_a_two_rank_launch_and_a_usage_error_after_start_leave_nothing_in_dev_shm(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    args = [str(corpus), *TINY, "--max-update", "2", "--batch-size", "2", "--disable-validation"]
    port = free_port()
    assert shm_leftovers(port) == []
    result = run(args + ["--save-dir", str(tmp_path / "ckpt")], launcher="deepspeed", port=port)
    assert (tmp_path / "ckpt" / "checkpoint_last").is_file(), result.stderr[-2000:]
    assert shm_leftovers(port) == []
    # Refused by the restore plan: the process group, and so the buffers, exist by then.
    port = free_port()
    refused = run(args + ["--restore-file", str(tmp_path / "nowhere")], launcher="deepspeed", check=False, port=port)
    assert refused.returncode == 2 and "--restore-file: no checkpoint at" in refused.stderr, refused.stderr[-2000:]
    assert shm_leftovers(port) == []


@pytest.mark.slow
def test_ctrl_c_during_a_two_rank_launch_leaves_nothing_in_dev_shm(tmp_path):
    corpus, port, log = write_corpus(tmp_path / "corpus"), free_port(), tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
           "--module", "metaseq_ds.cli.train", str(corpus), *TINY, "--max-update", "100000", "--batch-size", "2",
           "--no-save", "--disable-validation"]
    with open(log, "w") as out:  # a session of its own: Ctrl-C reaches the launcher and the ranks, as in a terminal
        launch = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True)
    try:
        deadline = time.time() + 300
        while "train_inner" not in log.read_text() and launch.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert launch.poll() is None, log.read_text()[-3000:]  # training, not finished or failed
        os.killpg(launch.pid, signal.SIGINT)
        launch.wait(timeout=120)
    finally:
        _kill_what_is_left(launch.pid)
    assert shm_leftovers(port) == []


def _kill_what_is_left(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
