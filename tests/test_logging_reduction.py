"""Logging outputs to metrics (`logging.reduction`): summed or gathered over 2 gloo ranks, and
`reduce_and_log` under the aggregators the trainer opens."""

import math
from pathlib import Path

import pytest
import torch

from launch import run_worker
from metaseq_ds.criterions import CrossEntropyCriterion
from metaseq_ds.errors import UsageError
from metaseq_ds.logging import metrics
from metaseq_ds.logging.reduction import combine_over_ranks, read_values, reduce_and_log
from metaseq_ds.tasks import BaseTask



@pytest.fixture(autouse=True)
def fresh_metrics():
    """The aggregators are global: each test starts and leaves them empty."""
    metrics.reset()
    yield
    metrics.reset()

def test_two_ranks_sum_key_by_key_or_gather_every_output():
    report = run_worker(Path(__file__).with_name("logging_reduction_worker.py"), "REDUCTION", ranks=2)
    # rank 0: losses 1.5, 2.5, rank 1: 2.5, 3.5; tokens 10 + 10 + 20 + 20
    assert report["summed"] == [{"loss": 10.0, "nsentences": 8, "ntokens": 60, "scale": 1.0}]
    assert report["types"] == {"loss": "float", "nsentences": "int", "ntokens": "int", "scale": "float"}
    assert [o["loss"] for o in report["gathered"]] == [1.5, 2.5, 2.5, 3.5]  # rank order, tensors as numbers
    assert [o["sentence_nll"] for o in report["gathered"]] == [[0.0, 0.0], [1.0, 0.0], [1.0, 10.0], [2.0, 10.0]]
    assert report["only_rank_0"] == [{"loss": 1.5, "nsentences": 2, "ntokens": 10, "scale": 0.25}]
    # unread (a training update's): the tensors' sum left on the device, the host numbers exact
    assert report["unread_types"] == {"loss": "Tensor", "nsentences": "int", "ntokens": "int", "scale": "float"}
    assert report["unread"] == report["summed"]


def test_alone_the_sums_are_this_ranks_and_a_key_that_cannot_be_summed_is_named():
    outputs = [{"loss": torch.tensor(2.0), "ntokens": 3}, {"loss": torch.tensor(4.0), "ntokens": 5}]
    assert combine_over_ranks(outputs, summable=True) == [{"loss": 6.0, "ntokens": 8}]
    assert combine_over_ranks(outputs, summable=False) == [{"loss": 2.0, "ntokens": 3}, {"loss": 4.0, "ntokens": 5}]
    with pytest.raises(UsageError, match="logging output 'ids' is a list; .* logging_outputs_can_be_summed"):
        combine_over_ranks([{"ids": [1, 2]}], summable=True)


def test_unread_sums_stay_tensors_until_one_read_of_them_all():
    outputs = [{"loss": torch.tensor(2.0), "ntokens": 3, "extra": 0.5}, {"loss": torch.tensor(4.0), "ntokens": 5, "extra": 1}]
    (unread,) = combine_over_ranks(outputs, summable=True, read=False)
    assert torch.is_tensor(unread["loss"]) and unread["ntokens"] == 8 and unread["extra"] == 1.5
    updates = [unread, {"loss": torch.tensor(1.0), "gnorm": torch.tensor(0.5), "step_applied": True}]
    with torch.profiler.profile() as profile:
        read = read_values(updates)
    assert read == [{"loss": 6.0, "ntokens": 8, "extra": 1.5}, {"loss": 1.0, "gnorm": 0.5, "step_applied": True}]
    assert [event.name for event in profile.events()].count("aten::_local_scalar_dense") == 0  # one tolist
    assert torch.is_tensor(updates[0]["loss"])  # the input is left as it was


def test_the_criterions_metrics_reach_every_open_aggregator_and_come_back():
    task = BaseTask(None)
    output = {"loss": 8 * math.log(2) * 4, "ntokens": 4, "nsentences": 2, "sample_size": 4}
    with metrics.aggregate("train", new_root=True), metrics.aggregate("train_inner"):
        values = reduce_and_log(task, CrossEntropyCriterion(None), [output])
        reduce_and_log(task, CrossEntropyCriterion(None), [{**output, "loss": 6 * math.log(2) * 4}])
    assert values["loss"] == pytest.approx(8.0) and values["ppl"] == pytest.approx(256.0)
    assert values["wpb"] == 4 and values["bsz"] == 2
    line = metrics.get_smoothed_values("train_inner")
    assert line["loss"] == pytest.approx(7.0) and line["ppl"] == pytest.approx(128.0) and "wps" in line


def test_a_criterion_that_logs_no_loss_gets_minus_one(caplog):
    class Silent(CrossEntropyCriterion):
        @staticmethod
        def reduce_metrics(logging_outputs):
            metrics.log_scalar("accuracy", 0.5)

    with metrics.aggregate(new_root=True):
        values = reduce_and_log(BaseTask(None), Silent(None), [{"ntokens": 1}])
    assert values["loss"] == -1 and values["accuracy"] == 0.5
