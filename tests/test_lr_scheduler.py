"""LR schedules against metaseq's formulas, written out independently here."""

import math

import pytest
import torch

from metaseq_ds.dataclass import validate_config
from metaseq_ds.errors import UsageError
from metaseq_ds.optim import MetaseqSGDWConfig, build_optimizer
from metaseq_ds.optim.lr_scheduler import (
    LR_SCHEDULER_REGISTRY,
    CosineLRScheduleConfig,
    InverseSquareRootLRScheduleConfig,
    PolynomialDecayLRScheduleConfig,
    build_lr_scheduler,
)


def make_optimizer(lr=1.0):
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    groups = [{"params": params[:1]}, {"params": params[1:]}]
    return build_optimizer(validate_config(MetaseqSGDWConfig, {"lr": lr}), groups)


def schedule(config_cls, **values):
    optimizer = make_optimizer(values.get("lr", 1.0))
    return build_lr_scheduler(validate_config(config_cls, values), optimizer), optimizer


def assert_schedule(scheduler, optimizer, expected):
    for t, lr in expected.items():
        assert scheduler.step_update(t) == pytest.approx(lr, abs=1e-12), f"update {t}"
        # The lr must land in every param group of the torch optimizer that steps.
        assert [g["lr"] for g in optimizer.optimizer.param_groups] == pytest.approx([lr, lr], abs=1e-12)


def test_inverse_sqrt():
    W, lr = 4, 1.0
    scheduler, optimizer = schedule(InverseSquareRootLRScheduleConfig, lr=lr, warmup_updates=W)
    assert optimizer.get_lr() == 0.0  # set at construction: the lr of update 0
    expected = {t: t / W * lr for t in (0, 1, 2, 3)}
    expected.update({t: lr / math.sqrt(t / W) for t in (4, 5, 9, 16, 100)})
    assert_schedule(scheduler, optimizer, expected)


def test_inverse_sqrt_warmup_init_lr_and_no_warmup():
    scheduler, optimizer = schedule(InverseSquareRootLRScheduleConfig, lr=1.0, warmup_updates=4, warmup_init_lr=0.2)
    assert_schedule(scheduler, optimizer, {0: 0.2, 2: 0.2 + 2 * 0.8 / 4, 4: 1.0})
    with pytest.raises(UsageError, match="^warmup_updates must be >= 1, got 0$"):
        schedule(InverseSquareRootLRScheduleConfig, lr=1.0, warmup_updates=0)


def polynomial(t, lr, end, W, T, power, zero=0):
    if zero and t <= zero:
        return 0.0
    if W and t <= zero + W:
        return (t - zero) / W * lr
    if t >= T:
        return end
    return (lr - end) * (1 - (t - zero - W) / (T - zero - W)) ** power + end


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_polynomial_decay(power):
    W, T, lr, end = 4, 20, 1.0, 0.1
    scheduler, optimizer = schedule(
        PolynomialDecayLRScheduleConfig, lr=lr, warmup_updates=W, total_num_update=T, end_learning_rate=end, power=power
    )
    steps = (0, 2, 4, 5, 12, 19, 20, 25)
    expected = {t: polynomial(t, lr, end, W, T, power) for t in steps}
    assert expected[2] == 0.5 and expected[4] == 1.0 and expected[20] == end and expected[25] == end
    assert_schedule(scheduler, optimizer, expected)


def test_polynomial_decay_zero_lr_warmup_steps_and_no_warmup():
    W, T, Z, lr = 4, 20, 2, 1.0
    scheduler, optimizer = schedule(
        PolynomialDecayLRScheduleConfig, lr=lr, warmup_updates=W, total_num_update=T, zero_lr_warmup_steps=Z
    )
    expected = {t: polynomial(t, lr, 0.0, W, T, 1.0, zero=Z) for t in (0, 1, 2, 3, 4, 6, 7, 13, 20)}
    assert expected[2] == 0.0 and expected[4] == 0.5 and expected[6] == 1.0
    assert_schedule(scheduler, optimizer, expected)

    scheduler, optimizer = schedule(PolynomialDecayLRScheduleConfig, lr=lr, total_num_update=10)
    assert_schedule(scheduler, optimizer, {0: 1.0, 5: 0.5, 10: 0.0})


def test_polynomial_decay_needs_total_num_update():
    with pytest.raises(UsageError, match="--total-num-update"):
        schedule(PolynomialDecayLRScheduleConfig, lr=1.0)


def cosine(t, lr, min_lr, W, warmup_init, period, t_mult, shrink):
    """Warmup, then walk the restarts period by period."""
    if t < W:
        return warmup_init + t * (lr - warmup_init) / W
    t -= W
    i = 0
    while t >= period:
        t -= period
        period *= t_mult
        i += 1
    low, high = min_lr * shrink**i, lr * shrink**i
    return low + (high - low) * (1 + math.cos(math.pi * t / period)) / 2


def test_cosine_with_growing_periods_and_shrink():
    W, lr, min_lr, P = 2, 1.0, 0.1, 4
    scheduler, optimizer = schedule(
        CosineLRScheduleConfig, lr=lr, min_lr=min_lr, warmup_updates=W, lr_period_updates=P, t_mult=2, lr_shrink=0.5
    )
    steps = (0, 1, 2, 3, 4, 5, 7, 10, 13, 14, 17, 27, 29)  # periods after warmup: [2,6) [6,14) [14,30)
    expected = {t: cosine(t, lr, min_lr, W, min_lr, P, 2, 0.5) for t in steps}
    assert expected[0] == min_lr and expected[2] == lr  # warmup starts at min_lr by default
    assert expected[14] == pytest.approx(0.25)  # third period restarts at lr * 0.5**2
    assert_schedule(scheduler, optimizer, expected)


def test_cosine_period_from_max_update():
    lr, min_lr = 1.0, 0.0
    scheduler, optimizer = schedule(CosineLRScheduleConfig, lr=lr, min_lr=min_lr, max_update=10, lr_shrink=0.1)
    expected = {t: cosine(t, lr, min_lr, 0, 0.0, 10, 1, 0.1) for t in (0, 5, 9, 10, 15)}
    assert expected[5] == pytest.approx(0.5) and expected[10] == pytest.approx(0.1)
    assert_schedule(scheduler, optimizer, expected)
    with pytest.raises(UsageError, match="--max-update"):
        schedule(CosineLRScheduleConfig, lr=lr)
    with pytest.raises(UsageError, match="--min-lr"):
        schedule(CosineLRScheduleConfig, lr=0.1, min_lr=0.2, max_update=10)


def test_state_dict_round_trip_keeps_best_val_loss():
    scheduler, _ = schedule(InverseSquareRootLRScheduleConfig, lr=1.0, warmup_updates=4)
    scheduler.step(1, val_loss=3.0)
    scheduler.step(2, val_loss=2.5)
    scheduler.step(3, val_loss=2.7)
    assert scheduler.best == 2.5
    resumed, optimizer = schedule(InverseSquareRootLRScheduleConfig, lr=1.0, warmup_updates=4)
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed.best == 2.5
    # The schedule itself resumes from the update count alone.
    assert resumed.step_update(9) == scheduler.step_update(9) == optimizer.get_lr()


def test_registry():
    assert {"inverse_sqrt", "polynomial_decay", "cosine"} <= set(LR_SCHEDULER_REGISTRY.choices())
    cfg = validate_config(CosineLRScheduleConfig, {"max_update": 10})
    cfg._name = "cosin"
    with pytest.raises(UsageError, match="did you mean 'cosine'"):
        build_lr_scheduler(cfg, make_optimizer())
