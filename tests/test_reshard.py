"""Resharding keeps the optimizer: a checkpoint resumes on another rank count, ZeRO stage,
tensor-parallel degree (test_tensor_parallel) or precision with its fp32 master weights, Adam
moments and step, so the next updates are an unbroken run's; `mseq reshard` writes the same
state consolidated; its bad input is one line, exit 2, nothing written."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from convert_helpers import TINY_MODEL, build_model
from launch import TINY, env, losses, run, tree_digest, write_corpus
from metaseq_ds.checkpoint.files import write_module_checkpoint
from metaseq_ds.cli.main import app
from metaseq_ds.options import parse_train_config

NO_DROPOUT = [*TINY, "--dropout", "0", "--attention-dropout", "0", "--disable-validation"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _gap(reference, other, steps):
    assert sorted(other) == list(steps), other
    return max(abs(other[step] - reference[step]) / reference[step] for step in steps)


def test_zero3_save_resumes_on_one_rank_zero0_and_on_zero1_as_an_unbroken_run(corpus, tmp_path):
    common = [str(corpus), *NO_DROPOUT, "--max-update", "6"]
    unbroken = losses(run(common + ["--batch-size", "8", "--no-save"]).stdout)
    zero3 = tmp_path / "zero3"
    run([str(corpus), *NO_DROPOUT, "--max-update", "3", "--batch-size", "4", "--zero-stage", "3",
         "--save-dir", str(zero3)], launcher="deepspeed")
    for name in ("zero0", "zero1", "reset"):
        shutil.copytree(zero3, tmp_path / name)

    zero0 = run(common + ["--batch-size", "8", "--save-dir", str(tmp_path / "zero0")])
    assert "Adam moments and step 3" in zero0.stderr + zero0.stdout
    assert _gap(unbroken, losses(zero0.stdout), [4, 5, 6]) <= 1e-5
    zero1 = run(common + ["--batch-size", "4", "--zero-stage", "1", "--save-dir", str(tmp_path / "zero1")],
                launcher="deepspeed")
    assert _gap(unbroken, losses(zero1.stdout), [4, 5, 6]) <= 1e-5
    # Without Adam's moments (today's --reset-optimizer, the old behaviour) update 5 is another run's:
    # the equalities above would fail if the moments were dropped.
    reset = losses(run(common + ["--batch-size", "8", "--reset-optimizer", "--save-dir", str(tmp_path / "reset")]).stdout)
    assert reset[4] == pytest.approx(unbroken[4], rel=1e-6)  # the loss before the first resumed step
    assert _gap(unbroken, reset, [4, 5, 6]) > 1e-3

    # mseq reshard: the same state, consolidated; a bf16 run resumes from it with update-freq 2.
    out = tmp_path / "one_rank"
    subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "reshard", str(zero3), str(out), "--ranks", "1"],
                   check=True, capture_output=True, env=env())
    meta = json.loads((out / "checkpoint_1_3" / "metaseq_ds.json").read_text())
    assert meta["consolidated"] and meta["optimizer_step"] == 3 and meta["target_layout"]["world_size"] == 1
    resumed = run(common + ["--batch-size", "8", "--save-dir", str(out)])
    assert losses(resumed.stdout) == {step: unbroken[step] for step in (4, 5, 6)}
    shutil.copytree(zero3, tmp_path / "bf16")
    bf16 = run(common + ["--batch-size", "4", "--update-freq", "2", "--bf16", "--save-dir", str(tmp_path / "bf16")])
    assert "now 1 rank(s) with ZeRO-0 in bf16" in bf16.stderr + bf16.stdout
    # bf16 rounding only: the moments and step came along (the --reset-optimizer run is 1.3e-2 off at update 6).
    assert _gap(unbroken, losses(bf16.stdout), [4, 5, 6]) <= 6e-3


# ---- mseq reshard: bad input -----------------------------------------------------------------

def _reshard(*args):
    return CliRunner().invoke(app, ["reshard", *map(str, args)])


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """A one-rank ZeRO-0 save of a 4-head model without optimizer state (what an import writes,
    not marked as weights only)."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # as `mseq` runs here: DeepSpeed's detection says nothing
    cfg = parse_train_config(["/data", *TINY_MODEL, "--save-dir", str(tmp_path / "ckpt")])
    meta = {"config": cfg.to_dict()}
    write_module_checkpoint(tmp_path / "ckpt", "checkpoint_1_5", build_model(cfg.model).state_dict(), meta)
    assert cfg.model.decoder_attention_heads == 4
    return tmp_path / "ckpt"


@pytest.mark.parametrize("case", ["not_a_checkpoint", "no_optimizer_state", "heads", "ranks", "stage", "out_not_empty"])
def test_bad_reshard_input_is_one_line_exit_2_and_nothing_written(case, saved, tmp_path):
    out = tmp_path / "out"
    ckpt, flags, expected = saved, ["--ranks", "2"], ""
    if case == "not_a_checkpoint":
        ckpt, expected = tmp_path, "is not a checkpoint"
    elif case == "no_optimizer_state":
        expected = "optimizer state"
    elif case == "heads":
        flags, expected = ["--ranks", "3", "--tensor-parallel-size", "3"], \
            "--tensor-parallel-size 3 does not divide --decoder-attention-heads 4"
    elif case == "ranks":
        flags, expected = ["--ranks", "3", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2 does not divide --ranks 3"
    elif case == "stage":
        flags, expected = ["--ranks", "1", "--zero-stage", "4"], "--zero-stage must be in [0, 3], got 4"
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        expected = "already exists and is not empty"
    before = tree_digest(tmp_path)
    result = _reshard(ckpt, out, *flags)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mseq reshard: error:") and expected in lines[0], result.output
    assert tree_digest(tmp_path) == before


def test_vocabulary_rows_a_larger_tensor_parallel_degree_adds_start_with_zero_moments():
    from metaseq_ds.checkpoint.optimizer_state import SavedOptimizerState, _whole_value

    saved_rows = torch.rand(6, 2)
    state = SavedOptimizerState(lambda key: {"decoder.embed_tokens.weight": saved_rows}, step=3, source="ckpt")
    grown = _whole_value(state, "exp_avg", "decoder.embed_tokens.weight", (8, 2))
    assert torch.equal(grown[:6], saved_rows) and not grown[6:].any()
    assert _whole_value(state, "fp32", "decoder.embed_tokens.weight", (8, 2)) is None  # materialisation's values stay
