"""metaseq's metrics API: nested aggregation, derived values, plain numbers, state."""

import json
import math
import time

import pytest
import torch

from metaseq_ds.logging import meters, metrics


@pytest.fixture(autouse=True)
def fresh_metrics():
    metrics.reset()
    yield
    metrics.reset()


def test_nested_aggregators_each_see_the_values_logged_inside_them():
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 4.0)
        with metrics.aggregate("train_inner"):
            metrics.log_scalar("loss", 2.0)
        with metrics.aggregate("train_inner"):  # reused by name
            metrics.log_scalar("loss", 3.0)
    assert metrics.get_smoothed_values("train_inner")["loss"] == 2.5
    assert metrics.get_smoothed_values("train")["loss"] == 3.0
    assert metrics.get_smoothed_values("default")["loss"] == 3.0


def test_new_root_hides_values_from_enclosing_aggregators():
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 1.0)
        with metrics.aggregate("valid", new_root=True):
            metrics.log_scalar("loss", 9.0)
        metrics.log_scalar("loss", 3.0)  # "train" is active again
    assert metrics.get_smoothed_values("valid")["loss"] == 9.0
    assert metrics.get_smoothed_values("train")["loss"] == 2.0
    assert metrics.get_smoothed_values("default")["loss"] == 2.0


def test_aggregator_is_closed_even_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with metrics.aggregate("broken", new_root=True):
            raise RuntimeError
    metrics.log_scalar("x", 1.0)
    assert metrics.get_meter("broken", "x") is None and metrics.get_smoothed_value("default", "x") == 1.0


def test_weighted_average_tensors_and_rounding_give_plain_numbers():
    with metrics.aggregate("train") as agg:
        metrics.log_scalar("loss", torch.tensor(1.0), weight=1, round=3)
        metrics.log_scalar("loss", torch.tensor(4.0), weight=2, round=3)
        metrics.log_scalar("lr", 1e-3, weight=0)
        metrics.log_scalar("lr", 5e-4, weight=0)  # weight 0: the latest value
    values = metrics.get_smoothed_values("train")
    assert values["loss"] == 3.0 and type(values["loss"]) is float
    assert values["lr"] == 5e-4
    assert agg is metrics.get_meters("train")
    json.dumps(values)


def test_derived_ppl_follows_the_loss():
    with metrics.aggregate("valid", new_root=True):
        metrics.log_scalar("loss", 3.0)
        metrics.log_derived("ppl", lambda m: metrics.get_perplexity(m["loss"].avg))
    assert metrics.get_smoothed_values("valid")["ppl"] == 8.0
    with metrics.aggregate("valid", new_root=True):
        metrics.log_scalar("loss", 5.0)
    assert metrics.get_smoothed_values("valid")["ppl"] == 2**4.0
    assert metrics.get_perplexity(1e6) == math.inf


def test_values_come_out_in_priority_order_and_private_keys_stay_hidden():
    with metrics.aggregate("train"):
        metrics.log_scalar("wps", 100.0, priority=90)
        metrics.log_scalar("loss", 1.0, priority=10)
        metrics.log_scalar("_internal", 1.0)
        metrics.log_derived("ppl", lambda m: 2 ** m["loss"].avg)
    assert list(metrics.get_smoothed_values("train")) == ["loss", "ppl", "wps"]


def test_reset_meters_starts_a_fresh_window():
    with metrics.aggregate("train_inner"):
        metrics.log_scalar("loss", 10.0)
    metrics.reset_meters("train_inner")
    with metrics.aggregate("train_inner"):
        metrics.log_scalar("loss", 2.0)
    assert metrics.get_smoothed_values("train_inner")["loss"] == 2.0


def test_timers_and_speed():
    with metrics.aggregate("train"):
        metrics.log_start_time("train_wall")
        time.sleep(0.01)
        metrics.log_stop_time("train_wall")
        metrics.log_speed("wps", 0)  # first call starts the clock
        metrics.log_speed("wps", 1000)
    values = metrics.get_smoothed_values("train")
    assert values["train_wall"] >= 0.01
    assert values["wps"] > 0
    assert isinstance(metrics.get_meter("train", "train_wall"), meters.StopwatchMeter)


def test_state_dict_round_trip():
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", torch.tensor(2.0), weight=3)
        metrics.log_derived("ppl", lambda m: 2 ** m["loss"].avg)
    state = metrics.state_dict()
    json.dumps(state)  # checkpoints store it; numbers only, no tensors
    metrics.reset()
    metrics.load_state_dict(state)
    with metrics.aggregate("train"):
        metrics.log_scalar("loss", 6.0, weight=1)
    assert metrics.get_smoothed_values("train")["loss"] == 3.0
    metrics.log_scalar("after_load", 1.0)  # "default" is still the active one after loading
    assert metrics.get_smoothed_value("default", "after_load") == 1.0
