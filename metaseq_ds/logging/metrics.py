"""Metrics logged from anywhere, aggregated by the contexts active at the time (metaseq's API).

    with metrics.aggregate("train"):
        with metrics.aggregate("train_inner"):
            metrics.log_scalar("loss", loss, sample_size)
        print(metrics.get_smoothed_values("train_inner"))  # {"loss": ...}, plain numbers
        metrics.reset_meters("train_inner")

Every value also reaches the "default" aggregator unless a context is opened with
`new_root=True` (as validation does, to keep its numbers apart).
"""

import contextlib
import uuid
from collections import OrderedDict, defaultdict
from typing import Callable, Dict, List, Optional

from metaseq_ds.logging.meters import (
    AverageMeter,
    DerivedMeter,
    Meter,
    MetersDict,
    StopwatchMeter,
    TimeMeter,
    safe_round,
    to_number,
)

_aggregators: Dict[str, MetersDict] = OrderedDict()
_active_aggregators: Dict[str, MetersDict] = OrderedDict()
_active_aggregators_cnt: Dict[str, int] = defaultdict(int)


def reset() -> None:
    """Forget every aggregator; only "default" remains, and it is active."""
    _aggregators.clear()
    _active_aggregators.clear()
    _active_aggregators_cnt.clear()
    _aggregators["default"] = MetersDict()
    _active_aggregators["default"] = _aggregators["default"]
    _active_aggregators_cnt["default"] = 1


reset()


@contextlib.contextmanager
def aggregate(name: Optional[str] = None, new_root: bool = False):
    """Record values logged inside the block under `name` (reused if it exists; a temporary
    aggregator without a name). With `new_root`, the enclosing aggregators do not see them."""
    if name is None:
        name = str(uuid.uuid4())
        agg = MetersDict()
    else:
        assert name != "default", "the default aggregator is always active"
        agg = _aggregators.setdefault(name, MetersDict())

    if new_root:
        backup_aggregators = _active_aggregators.copy()
        backup_aggregators_cnt = _active_aggregators_cnt.copy()
        _active_aggregators.clear()
        _active_aggregators_cnt.clear()

    _active_aggregators[name] = agg
    _active_aggregators_cnt[name] += 1
    try:
        yield agg
    finally:
        _active_aggregators_cnt[name] -= 1
        if _active_aggregators_cnt[name] == 0 and name in _active_aggregators:
            del _active_aggregators[name]
        if new_root:
            _active_aggregators.clear()
            _active_aggregators.update(backup_aggregators)
            _active_aggregators_cnt.clear()
            _active_aggregators_cnt.update(backup_aggregators_cnt)


def get_active_aggregators() -> List[MetersDict]:
    return list(_active_aggregators.values())


def log_scalar(key: str, value: float, weight: float = 1, priority: int = 10, round: Optional[int] = None):
    """Add `value` to the weighted average `key` (weight 0: the latest value is reported)."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, AverageMeter(round=round), priority)
        agg[key].update(value, weight)


def log_derived(key: str, fn: Callable[[MetersDict], float], priority: int = 20):
    """Report `fn(meters)` as `key`, computed from the other meters when read."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, DerivedMeter(fn), priority)


def log_speed(key: str, value: float, priority: int = 30, round: Optional[int] = None):
    """Report the rate of `value` per second; the first call starts the clock."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, TimeMeter(round=round), priority)
            agg[key].reset()
        else:
            agg[key].update(value)


def log_start_time(key: str, priority: int = 40, round: Optional[int] = None):
    """Start timing `key`; `log_stop_time` adds the elapsed seconds."""
    for agg in get_active_aggregators():
        if key not in agg:
            agg.add_meter(key, StopwatchMeter(round=round), priority)
        agg[key].start()


def log_stop_time(key: str, weight: float = 0.0, prehook: Optional[Callable[[], None]] = None):
    """Stop timing `key`. With weight 0 the total time is reported, else the weighted average.
    `prehook` runs before the clock stops (e.g. torch.cuda.synchronize)."""
    for agg in get_active_aggregators():
        if key in agg:
            agg[key].stop(weight, prehook)


def reset_meter(name: str, key: str) -> None:
    meter = get_meter(name, key)
    if meter is not None:
        meter.reset()


def reset_meters(name: str) -> None:
    meters = get_meters(name)
    if meters is not None:
        meters.reset()


def get_meter(name: str, key: str) -> Optional[Meter]:
    """The meter `key` of aggregator `name`, or None if nothing was logged there."""
    if name not in _aggregators:
        return None
    return _aggregators[name].get(key, None)


def get_meters(name: str) -> Optional[MetersDict]:
    return _aggregators.get(name, None)


def get_smoothed_value(name: str, key: str) -> float:
    return _aggregators[name].get_smoothed_value(key)


def get_smoothed_values(name: str) -> Dict[str, float]:
    """Every value of aggregator `name` as plain numbers, in priority order."""
    return _aggregators[name].get_smoothed_values()


def state_dict():
    return OrderedDict((name, agg.state_dict()) for name, agg in _aggregators.items())


def load_state_dict(state_dict):
    # Load into the existing MetersDict objects: active contexts hold references to them.
    for name, agg_state in state_dict.items():
        _aggregators.setdefault(name, MetersDict()).load_state_dict(agg_state)


def get_perplexity(loss, round: int = 2, base: float = 2):
    """`base ** loss` for a loss in that base (inf if it overflows), as metaseq reports ppl."""
    if loss is None:
        return 0.0
    try:
        return safe_round(base ** to_number(loss), round)
    except OverflowError:
        return float("inf")
