"""A diverging run stops with one line naming the update and the likely causes, exit code 3, and
leaves the last checkpoint as it was; log lines survive extreme values on the way."""

import json
import logging
import math

import pytest
import torch

from launch import TINY, log_records, run, tree_digest, write_corpus
from metaseq_ds.divergence import TrainingDiverged, check_update
from metaseq_ds.criterions import CrossEntropyCriterion
from metaseq_ds.logging import metrics
from metaseq_ds.logging.progress_bar import StatsSink
from metaseq_ds.options import parse_train_config
from metaseq_ds.tasks import BaseTask
from metaseq_ds.validation import validate

FINITE = {"loss": 8.0, "gnorm": 1.5, "sample_size": 256, "ntokens": 256, "step_applied": True}


def _config(*flags):
    return parse_train_config(["/data", "--lr", "0.5", *flags])



@pytest.fixture(autouse=True)
def fresh_metrics():
    """The aggregators are global: each test starts and leaves them empty."""
    metrics.reset()
    yield
    metrics.reset()

@pytest.mark.parametrize("change, shown", [
    ({"loss": math.nan}, "loss nan bits per token (perplexity nan)"),
    ({"loss": math.inf}, "loss inf bits per token"),
    ({"loss": 4.3e8}, "loss 4.3e+08 bits per token (perplexity inf)"),  # finite, yet 2 ** loss overflows
    ({"gnorm": math.inf}, "gradient norm inf"),
    ({"gnorm": math.nan}, "gradient norm nan"),
])
def test_a_non_finite_update_stops_with_one_line_naming_update_and_causes(change, shown):
    with pytest.raises(TrainingDiverged) as raised:
        check_update({**FINITE, **change}, 7, _config(), last_saved=5)
    message = str(raised.value)
    assert message.startswith(f"update 7: {shown}" if shown.startswith("loss") else "update 7: loss 8 bits")
    assert shown in message and "\n" not in message and raised.value.exit_code == 3
    assert "the last checkpoint, update 5, is left as it was" in message
    assert message.endswith("Likely causes: --lr 0.5 is too high; --clip-norm 0 does not clip (1.0 is usual); "
                            "precision is fp32, so not a reduced-precision overflow")


def test_the_causes_name_this_runs_clipping_precision_and_saves():
    with pytest.raises(TrainingDiverged) as raised:
        check_update({**FINITE, "loss": math.nan}, 3, _config("--clip-norm", "2", "--bf16", "--no-save"), None)
    assert "(nothing is saved with --no-save)" in str(raised.value)
    assert str(raised.value).endswith("--clip-norm 2 is loose; bf16 overflows where fp32 would not (drop --bf16)")
    with pytest.raises(TrainingDiverged, match=r"\(no checkpoint was saved\)"):
        check_update({**FINITE, "loss": math.nan}, 3, _config(), None)


def test_an_overflow_step_that_deepspeed_skipped_goes_on():
    check_update({**FINITE, "gnorm": math.inf, "step_applied": False}, 3, _config(), 2)  # the loss scaler's job
    with pytest.raises(TrainingDiverged):  # a NaN loss is not an overflow the scaler can fix
        check_update({**FINITE, "loss": math.nan, "step_applied": False}, 3, _config(), 2)


def test_a_per_sentence_loss_is_judged_per_token():
    # 2000 bits per sentence of 500 tokens: 4 bits per token, a healthy run.
    check_update({**FINITE, "loss": 2000.0, "sample_size": 8, "ntokens": 4000}, 3, _config(), 2)


def test_log_lines_and_validation_survive_extreme_losses(caplog):
    caplog.set_level(logging.INFO)
    huge = {"loss": 4.3e8 * 256 * math.log(2), "ntokens": 256, "nsentences": 8, "sample_size": 256}
    with metrics.aggregate("train_inner", new_root=True):
        CrossEntropyCriterion.reduce_metrics([huge])
    line = metrics.get_smoothed_values("train_inner")
    assert line["ppl"] == math.inf
    StatsSink("json", None, "none", total=0, enabled=True).log("train_inner", line, 3)
    assert json.loads(caplog.records[-1].getMessage())["ppl"] == math.inf

    class HugeLoss(BaseTask):
        def valid_step(self, sample, model, criterion):
            return None, 1, {"loss": 2000.0 * math.log(2), "ntokens": 1, "sample_size": 1}

    criterion = CrossEntropyCriterion(None)
    values = validate(HugeLoss(None), None, criterion, [{}], device=torch.device("cpu"))
    assert values["loss"] == pytest.approx(2000.0) and values["ppl"] == math.inf


@pytest.mark.slow
def test_the_diverging_example_ends_with_one_line_exit_3_and_the_checkpoint_untouched(tmp_path):
    corpus, save_dir = write_corpus(tmp_path / "corpus"), tmp_path / "ckpt"
    args = [str(corpus), *TINY, "--save-dir", str(save_dir), "--save-interval-updates", "2", "--disable-validation"]
    run(args + ["--max-update", "2"])
    before = tree_digest(save_dir)
    # The issue's example, resumed from that checkpoint: update 3 takes a step of lr ~8e3, update 4's
    # loss shows it (about 4e8 bits per token: a perplexity beyond float64) before the save due at 4.
    result = run(args + ["--lr", "1e4", "--clip-norm", "0"], check=False, timeout=240)
    assert result.returncode == 3, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("mseq train: error: update 4: loss ") and "Traceback" not in result.stderr
    assert "perplexity inf" in lines[-1] and "Likely causes: --lr 10000 is too high" in lines[-1]
    assert [r["num_updates"] for r in log_records(result.stdout)] == [3]  # the diverged update is not logged
    assert tree_digest(save_dir) == before
