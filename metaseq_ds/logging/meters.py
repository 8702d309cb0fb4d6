"""Meters: running statistics behind `metaseq_ds.logging.metrics`.

Meters accept tensors (summing them without a device sync per update) but always report
plain Python numbers, since the JSON log and TensorBoard need numbers.
"""

import bisect
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

import torch


def to_number(value):
    """A one-element tensor or numpy scalar as a Python number; anything else unchanged."""
    if torch.is_tensor(value) or hasattr(value, "item"):
        return value.item()
    return value


def safe_round(number, ndigits: Optional[int]):
    number = to_number(number)
    if ndigits is None or number is None:
        return number
    return round(number, ndigits)


class Meter:
    """A running statistic with a `smoothed_value` to log."""

    def state_dict(self):
        return {}

    def load_state_dict(self, state_dict):
        pass

    def reset(self):
        raise NotImplementedError(f"{type(self).__name__} must define reset")

    @property
    def smoothed_value(self) -> float:
        raise NotImplementedError(f"{type(self).__name__} must define smoothed_value")


class AverageMeter(Meter):
    """Weighted average of the logged values (the latest value while the total weight is 0)."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.reset()

    def reset(self):
        self.val = None
        self.sum = 0
        self.count = 0

    def update(self, val, n=1):
        if val is not None:
            self.val = val
            if n > 0:
                self.sum = self.sum + val * n
                self.count = self.count + n

    def state_dict(self):
        return {"val": to_number(self.val), "sum": to_number(self.sum), "count": to_number(self.count), "round": self.round}

    def load_state_dict(self, state_dict):
        self.val = state_dict["val"]
        self.sum = state_dict["sum"]
        self.count = state_dict["count"]
        self.round = state_dict["round"]

    @property
    def avg(self):
        return to_number(self.sum / self.count if self.count > 0 else self.val)

    @property
    def smoothed_value(self) -> float:
        return safe_round(self.avg, self.round)


class TimeMeter(Meter):
    """Occurrences per second (e.g. words per second) since the last reset."""

    def __init__(self, init: float = 0, n: float = 0, round: Optional[int] = None):
        self.round = round
        self.reset(init, n)

    def reset(self, init: float = 0, n: float = 0):
        self.init = init
        self.start = time.perf_counter()
        self.n = n
        self.i = 0

    def update(self, val=1):
        self.n = self.n + val
        self.i += 1

    def state_dict(self):
        return {"init": self.elapsed_time, "n": to_number(self.n), "round": self.round}

    def load_state_dict(self, state_dict):
        self.reset(init=state_dict["init"], n=state_dict["n"])
        self.round = state_dict["round"]

    @property
    def avg(self):
        return to_number(self.n) / self.elapsed_time

    @property
    def elapsed_time(self) -> float:
        return self.init + (time.perf_counter() - self.start)

    @property
    def smoothed_value(self) -> float:
        return safe_round(self.avg, self.round)


class StopwatchMeter(Meter):
    """Total (or, with weights, average) duration of an event in seconds."""

    def __init__(self, round: Optional[int] = None):
        self.round = round
        self.sum = 0
        self.n = 0
        self.start_time = None

    def start(self):
        self.start_time = time.perf_counter()

    def stop(self, n=1, prehook: Optional[Callable[[], None]] = None):
        if self.start_time is not None:
            if prehook is not None:
                prehook()
            self.sum += time.perf_counter() - self.start_time
            self.n += n

    def reset(self):
        self.sum = 0
        self.n = 0
        self.start()

    def state_dict(self):
        return {"sum": self.sum, "n": to_number(self.n), "round": self.round}

    def load_state_dict(self, state_dict):
        self.sum = state_dict["sum"]
        self.n = state_dict["n"]
        self.start_time = None
        self.round = state_dict["round"]

    @property
    def avg(self):
        return self.sum / self.n if self.n > 0 else self.sum

    @property
    def elapsed_time(self) -> float:
        return 0.0 if self.start_time is None else time.perf_counter() - self.start_time

    @property
    def smoothed_value(self) -> float:
        return safe_round(self.avg if self.sum > 0 else self.elapsed_time, self.round)


class DerivedMeter(Meter):
    """A value computed from the other meters of its MetersDict (e.g. ppl from loss)."""

    def __init__(self, fn: Callable[["MetersDict"], float]):
        self.fn = fn

    def reset(self):
        pass


class MetersDict(OrderedDict):
    """Meters by key, kept in the order of the priority given when each was added."""

    _DerivedMeter = DerivedMeter  # fairseq code refers to MetersDict._DerivedMeter

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.priorities = []

    def __setitem__(self, key, value):
        assert key not in self, "MetersDict doesn't support reassignment"
        priority, meter = value
        bisect.insort(self.priorities, (priority, len(self.priorities), key))
        super().__setitem__(key, meter)
        for _, _, ordered_key in self.priorities:
            self.move_to_end(ordered_key)

    def add_meter(self, key: str, meter: Meter, priority: int):
        self[key] = (priority, meter)

    def state_dict(self):
        # Derived meters hold functions, which cannot be saved; reduce_metrics re-adds them.
        return [
            (priority, key, type(self[key]).__name__, self[key].state_dict())
            for priority, _, key in self.priorities
            if not isinstance(self[key], DerivedMeter)
        ]

    def load_state_dict(self, state_dict):
        self.clear()
        self.priorities.clear()
        for priority, key, meter_cls, meter_state in state_dict:
            meter = _SAVED_METERS[meter_cls]()
            meter.load_state_dict(meter_state)
            self.add_meter(key, meter, priority)

    def get_smoothed_value(self, key: str) -> float:
        meter = self[key]
        if isinstance(meter, DerivedMeter):
            return to_number(meter.fn(self))
        return meter.smoothed_value

    def unread_values(self) -> Dict[str, Any]:
        """The values `get_smoothed_values` would give, unrounded and without a read of the device:
        an average of tensors is a 0-dim tensor. Derived values (computed from read numbers) are
        left out."""
        return OrderedDict(
            (key, meter.sum / meter.count if meter.count > 0 else meter.val) if isinstance(meter, AverageMeter)
            else (key, meter.smoothed_value)
            for key, meter in self.items() if not key.startswith("_") and not isinstance(meter, DerivedMeter))

    def get_smoothed_values(self) -> Dict[str, float]:
        """All values, in priority order; keys starting with "_" are private and left out."""
        return OrderedDict((key, self.get_smoothed_value(key)) for key in self.keys() if not key.startswith("_"))

    def reset(self):
        for meter in self.values():
            meter.reset()


_SAVED_METERS = {cls.__name__: cls for cls in (AverageMeter, TimeMeter, StopwatchMeter)}
