"""User-dir plugins of the three styles train and validate as they did in fairseq/metaseq.

tests/plugins/lm_fairseq, lm_metaseq and lm_metaseq_ds are one plugin written against each
package's names: a label-smoothed criterion (summable logging outputs) and one that also reports
a maximum (gathered), an architecture chained on base_lm_architecture, a task whose `state`
survives checkpoints. Each trains with `mseq train --user-dir` after `mseq migrate` (the fairseq
one also unmigrated under METASEQ_DS_COMPAT=1), alone or on 2 ranks, and `mseq validate` reads
its checkpoint: every line carries the criterion's keys.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch import env, log_records, run, write_corpus

PLUGINS = Path(__file__).parent / "plugins"

FLAGS = ["--arch", "plugin_lm_tiny", "--task", "stamped_lm", "--tokens-per-sample", "32", "--log-format", "json",
         "--log-interval", "1", "--lr", "0.003", "--warmup-updates", "2", "--progress-bar", "none",
         "--label-smoothing", "0.1", "--max-valid-steps", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("plugins") / "corpus")


def migrated(style: str, tmp_path: Path) -> Path:
    """A copy of the plugin, after `mseq migrate` (a real process): nothing left to a person."""
    plugin = tmp_path / f"lm_{style}"
    shutil.copytree(PLUGINS / f"lm_{style}", plugin)
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "migrate", str(plugin)],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert result.returncode == 0 and "unresolved" not in result.stdout + result.stderr, result.stdout + result.stderr
    imports = [line.split()[1] for line in (plugin / "__init__.py").read_text().splitlines() if line.startswith("from ")]
    assert not [module for module in imports if module.split(".")[0] in ("fairseq", "metaseq")], imports
    return plugin


def validate(save_dir: Path, compat: bool = False, max_steps: str = "2") -> dict:
    """`mseq validate --path save_dir` (a real process): its valid line's values by key."""
    environment = {**env(), "METASEQ_DS_COMPAT": "1"} if compat else env()
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "validate", "--path", str(save_dir),
                             "--max-valid-steps", max_steps], capture_output=True, text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("valid: ")]
    shown = dict(part.split(" ", 1) for part in line.removeprefix("valid: ").split(" | ")[:-1])  # last: the checkpoint
    return {key: float(value) for key, value in shown.items()}


def by_update(stdout: str, *keys: str) -> dict:
    return {r["num_updates"]: tuple(r[key] for key in keys) for r in log_records(stdout)}


def test_a_fairseq_plugin_trains_and_validates_migrated_and_unmigrated(corpus, tmp_path, monkeypatch):
    plugin = migrated("fairseq", tmp_path)
    args = [str(corpus), *FLAGS, "--criterion", "label_smoothed_lm", "--max-update", "2"]
    result = run(args + ["--user-dir", str(plugin), "--save-dir", str(tmp_path / "migrated")])
    records = log_records(result.stdout)
    assert {"loss", "nll_loss", "ppl", "wpb", "task_stamp"} <= set(records[0])
    assert all(r["ppl"] == pytest.approx(2 ** r["nll_loss"], rel=1e-2) for r in records)
    valid = log_records(result.stdout, "valid")[-1]
    assert {"valid_loss", "valid_nll_loss", "valid_ppl", "valid_num_updates"} <= set(valid)
    train_line = log_records(result.stdout, "train")[-1]
    assert {"train_loss", "train_nll_loss", "train_ppl"} <= set(train_line)

    monkeypatch.setenv("METASEQ_DS_COMPAT", "1")
    unmigrated = run(args + ["--user-dir", str(PLUGINS / "lm_fairseq"), "--save-dir", str(tmp_path / "unmigrated")])
    assert by_update(unmigrated.stdout, "loss", "nll_loss") == by_update(result.stdout, "loss", "nll_loss")
    monkeypatch.delenv("METASEQ_DS_COMPAT")

    shown = validate(tmp_path / "migrated")  # the same weights and batches as the run's last valid line
    assert shown["loss"] == valid["valid_loss"] and shown["nll_loss"] == valid["valid_nll_loss"]
    assert validate(tmp_path / "unmigrated", compat=True)["nll_loss"] == shown["nll_loss"]


def test_a_metaseq_plugins_gathered_metric_on_two_ranks_is_the_whole_batchs(corpus, tmp_path):
    plugin = migrated("metaseq", tmp_path)
    args = [str(corpus), *FLAGS, "--criterion", "worst_sentence_lm", "--max-update", "2", "--user-dir", str(plugin),
            "--disable-validation", "--no-save"]
    alone = run(args + ["--batch-size", "8"])
    ranks = run(args + ["--batch-size", "4"], launcher="deepspeed")
    keys = ("loss", "nll_loss", "worst_sentence_nll")
    assert by_update(ranks.stdout, *keys).keys() == {1, 2}
    # Update 1: the same weights and the same 8 sentences; had the outputs only been summed, or the
    # maximum taken on one rank's 4, it would differ. Update 2 after one step of each optimizer.
    for update, tolerance in ((1, 1e-3), (2, 1e-2)):
        assert by_update(ranks.stdout, *keys)[update] == pytest.approx(by_update(alone.stdout, *keys)[update],
                                                                       abs=tolerance), update


def test_a_metaseq_ds_plugin_on_two_ranks_keeps_its_task_state_across_a_resume(corpus, tmp_path):
    plugin = PLUGINS / "lm_metaseq_ds"
    args = [str(corpus), *FLAGS, "--criterion", "label_smoothed_lm", "--user-dir", str(plugin), "--batch-size", "4",
            "--save-dir", str(tmp_path / "ckpt"), "--save-interval-updates", "2", "--max-valid-steps", "1000"]
    first = run(args + ["--max-update", "2"], launcher="deepspeed")
    resumed = run(args + ["--max-update", "3"], launcher="deepspeed")
    (stamp,) = {r["task_stamp"] for r in log_records(first.stdout)}
    assert [r["task_stamp"] for r in log_records(resumed.stdout)] == [stamp]  # the state came back, not rebuilt
    assert {"valid_nll_loss", "valid_ppl"} <= set(log_records(resumed.stdout, "valid")[-1])
    # The whole split, on 2 ranks there and in one process here: the same sums.
    assert validate(tmp_path / "ckpt", max_steps="1000")["nll_loss"] == log_records(resumed.stdout, "valid")[-1]["valid_nll_loss"]
