"""The suite neither reads nor writes the directory it is started from (tests/conftest.py).

After README command 1 (the demo) a checkout holds `checkpoints/` and `data/`; README command 2,
the suite, runs next from that checkout and must neither resume, refuse nor overwrite them.
"""

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from convert_helpers import TINY_MODEL, write_zero0_checkpoint
from launch import tree_digest

REPO = Path(__file__).resolve().parent.parent
# Tests whose runs use the working directory's defaults: `--save-dir checkpoints`, `data/demo_corpus`.
USES_CWD_DEFAULTS = [
    "tests/test_train.py::test_default_save_dir_is_checkpoints_in_the_working_directory",
    "tests/test_train.py::test_demo_writes_its_corpus_to_data_and_ends_with_loss_and_entropy",
]


def test_each_test_and_its_subprocesses_get_an_empty_directory_and_home():
    cwd, home = Path.cwd(), Path.home()
    assert not any(cwd.iterdir()) and not any(home.iterdir())
    assert home != Path(pwd.getpwuid(os.getuid()).pw_dir) and not REPO.is_relative_to(cwd)
    seen = subprocess.run([sys.executable, "-c", "import os, pathlib; print(os.getcwd()); print(pathlib.Path.home())"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert seen == [str(cwd), str(home)]
    # DeepSpeed's JIT-built ops stay in the real cache (minutes to rebuild).
    assert not Path(os.environ["TORCH_EXTENSIONS_DIR"]).is_relative_to(home)


def test_xdist_workers_share_the_cores_among_torch_threads_here_and_in_subprocesses(request):
    import torch

    workers = getattr(request.config, "workerinput", {}).get("workercount", 1)
    if workers == 1:  # `-n 0`: torch's own choice, untouched
        assert "OMP_NUM_THREADS" not in os.environ or torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
        return
    share = max(1, len(os.sched_getaffinity(0)) // workers)
    seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                          capture_output=True, text=True, check=True).stdout
    assert torch.get_num_threads() == share and int(seen) == share


def _pytest(cwd: Path, basetemp: Path, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "--rootdir", str(REPO),
           "--basetemp", str(basetemp), *options, *(str(REPO / test) for test in USES_CWD_DEFAULTS)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_tests_pass_from_a_directory_holding_another_models_checkpoints_and_data(tmp_path):
    checkout = tmp_path / "checkout"
    write_zero0_checkpoint(checkout / "checkpoints", TINY_MODEL)  # not the model those tests train
    (checkout / "data" / "demo_corpus").mkdir(parents=True)
    (checkout / "data" / "demo_corpus" / "notes.txt").write_text("not a demo corpus\n")
    before = tree_digest(checkout)

    isolated = _pytest(checkout, tmp_path / "isolated")
    assert isolated.returncode == 0 and "2 passed" in isolated.stdout, isolated.stdout[-3000:]
    assert tree_digest(checkout) == before

    # Without the isolation the same tests meet the stray directories (so they prove something):
    # first the checkpoints (checked before anything is written), then, without them, the data.
    exposed = _pytest(checkout, tmp_path / "exposed", "--noconftest")
    assert "2 failed" in exposed.stdout, exposed.stdout[-3000:]
    assert "holds a checkpoint of another model" in exposed.stdout
    shutil.rmtree(checkout / "checkpoints")
    exposed = _pytest(checkout, tmp_path / "exposed_data", "--noconftest", "-k", "demo")
    assert "1 failed" in exposed.stdout and "is not a demo corpus" in exposed.stdout, exposed.stdout[-3000:]
