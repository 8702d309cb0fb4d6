"""From a criterion's logging outputs to the logged metrics, as metaseq's trainer does it.

Each forward returns a logging output: a dict the criterion alone understands (numbers, 0-dim
tensors, anything its `reduce_metrics` reads). The outputs of one update (every micro-batch),
or of one validation split, are first combined over the data-parallel ranks:

- summed key by key when `criterion.logging_outputs_can_be_summed()`: one all-reduce of one
  float64 vector, the tensors staying on the device until then; a key that is an int on every
  micro-batch comes back an int;
- gathered otherwise: every rank's list, joined in rank order, tensors read to the host first.

Then `reduce_and_log` runs `task.reduce_metrics(outputs, criterion)` in a fresh
`metrics.aggregate()`: what it logs reaches every aggregator open at the time (train_inner,
train, default; or validation's own root), and this update's values come back as numbers.

A training update reads nothing from the device (`read=False`): each read is a host sync on a
GPU, which idles it while the host catches up. Its summed tensors stay on the device (the
meters sum them there), host numbers stay exact on the host, and the values it returns may be
0-dim device tensors, read with `read_values` once per log line for all updates since the last.
"""

import logging
import math
import numbers
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from metaseq_ds.errors import UsageError
from metaseq_ds.logging import metrics

logger = logging.getLogger(__name__)

LoggingOutput = Dict[str, Any]

def combine_over_ranks(logging_outputs: List[LoggingOutput], summable: bool, group=None,
                       may_be_empty: bool = False, read: bool = True) -> List[LoggingOutput]:
    """This rank's `logging_outputs`, combined with every other rank's of `group` (default: the
    world; one process: just this rank's): `[sums]` when `summable`, else the gathered list.

    `read=False` (summable only): the sums of keys with tensors are left as 0-dim float64
    tensors on the device, unread; keys of host numbers are summed as numbers.

    `may_be_empty`: some rank may have no outputs (a validation shard without a batch), so the
    ranks first agree on the keys (one more, small, collective); an update's ranks all have some."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if summable:
        keys = sorted(logging_outputs[0]) if logging_outputs else []
        if may_be_empty and world > 1:
            every_rank_keys: List[Optional[List[str]]] = [None] * world
            dist.all_gather_object(every_rank_keys, keys, group=group)
            keys = sorted(set().union(*every_rank_keys))
        return [_sum_over_ranks(logging_outputs, keys, group, alone=world == 1, read=read)]
    outputs = [_to_host(output) for output in logging_outputs]
    if world == 1:
        return outputs
    gathered: List[Optional[List[LoggingOutput]]] = [None] * world
    dist.all_gather_object(gathered, outputs, group=group)
    return [output for rank_outputs in gathered for output in rank_outputs]


def _sum_over_ranks(logging_outputs: List[LoggingOutput], keys: List[str], group, alone: bool,
                    read: bool) -> LoggingOutput:
    # Every rank must bring the same keys in the same order to one all-reduce: the first
    # output's keys, sorted (metaseq's rule: a criterion logs the same keys every batch).
    device = _collective_device(alone, logging_outputs)
    on_device, on_host = [], []
    for key in keys:
        values = [output.get(key, 0) for output in logging_outputs]
        for value in values:
            if not (torch.is_tensor(value) and value.numel() == 1) and not isinstance(value, numbers.Real):
                raise UsageError(
                    f"logging output {key!r} is a {type(value).__name__}; logging outputs that can be summed "
                    f"hold numbers or one-element tensors (return False from logging_outputs_can_be_summed "
                    f"to have them gathered instead)")
        tensors = [v.detach().reshape(()).to(device, torch.float64) for v in values if torch.is_tensor(v)]
        on_device.append(torch.stack(tensors).sum() if tensors else torch.zeros((), dtype=torch.float64, device=device))
        on_host.append(math.fsum(float(v) for v in values if not torch.is_tensor(v)))
    if not keys:
        return {}
    integer = {key for key in keys if all(isinstance(o.get(key, 0), numbers.Integral) for o in logging_outputs)}
    if not read:
        return _unread_sums(logging_outputs, keys, on_device, on_host, integer, group, alone)
    if alone:  # one read of the device; the host's numbers stay exact where they are
        totals = [tensor + host for tensor, host in zip(torch.stack(on_device).tolist(), on_host)]
    else:  # one copy to the device, one all-reduce, one read back: the update's only sync for its log
        totals = torch.stack(on_device) + torch.tensor(on_host, dtype=torch.float64).to(device, non_blocking=True)
        dist.all_reduce(totals, group=group)
        totals = totals.tolist()
    return {key: int(total) if key in integer else total for key, total in zip(keys, totals)}


def _unread_sums(logging_outputs: List[LoggingOutput], keys: List[str], on_device: List[torch.Tensor],
                 on_host: List[float], integer, group, alone: bool) -> LoggingOutput:
    """The sums without a read of the device: the tensors' one all-reduce stays on the device;
    the host numbers are summed on the host (on several NCCL ranks their small collective is
    read back: a criterion branches on them, as metaseq's cross_entropy does on sample_size)."""
    from metaseq_ds.distributed.utils import all_reduce_sum

    with_tensors = [i for i, key in enumerate(keys) if any(torch.is_tensor(o.get(key)) for o in logging_outputs)]
    device_totals = torch.stack([on_device[i] for i in with_tensors]) if with_tensors else None
    if not alone:
        if device_totals is not None:
            dist.all_reduce(device_totals, group=group)
        on_host = all_reduce_sum(on_host, group=group)
    sums = {key: int(total) if key in integer else total for key, total in zip(keys, on_host)}
    for row, i in enumerate(with_tensors):
        sums[keys[i]] = device_totals[row] + on_host[i]
    return sums


def _collective_device(alone: bool, logging_outputs: List[LoggingOutput]) -> torch.device:
    """Where the sums are made: NCCL's collectives take the rank's GPU, gloo's the host; alone,
    the device of the outputs' tensors (no copy of them before the sum)."""
    if not alone:
        from metaseq_ds.distributed.utils import collective_device

        return collective_device()
    for output in logging_outputs:
        for value in output.values():
            if torch.is_tensor(value):
                return value.device
    return torch.device("cpu")


def _to_host(output: LoggingOutput) -> LoggingOutput:
    """One-element tensors as Python numbers, other tensors on the CPU (picklable, and what a
    criterion's reduce_metrics sums on any rank); everything else as it is."""
    return {key: _host_value(value) for key, value in output.items()}


def _host_value(value):
    if not torch.is_tensor(value):
        return value
    value = value.detach()
    return value.item() if value.numel() == 1 else value.cpu()


_warned_no_loss = False


def reduce_and_log(task, criterion, logging_outputs: List[LoggingOutput], read: bool = True) -> Dict[str, Any]:
    """`task.reduce_metrics` on the combined outputs inside a fresh aggregator nested in the open
    ones; the values it logged, as numbers (`read=False`: as `MetersDict.unread_values`)."""
    global _warned_no_loss
    with metrics.aggregate() as values:
        task.reduce_metrics(logging_outputs, criterion)
        if "loss" not in values:
            # metaseq's rule: the divergence check, the progress bar and tools read "loss".
            if not _warned_no_loss:
                _warned_no_loss = True
                logger.warning(f"{type(criterion).__name__}.reduce_metrics logged no 'loss'; it is logged as -1")
            metrics.log_scalar("loss", -1)
        return dict(values.get_smoothed_values() if read else values.unread_values())


def read_values(stats: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Copies of `stats` with each 0-dim tensor as a Python number, all read in one transfer."""
    tensors = [(index, key, value) for index, values in enumerate(stats) for key, value in values.items()
               if torch.is_tensor(value)]
    read = [dict(values) for values in stats]
    if tensors:
        device = tensors[0][2].device
        numbers = torch.stack([value.detach().reshape(()).to(device, torch.float64) for _, _, value in tensors]).tolist()
        for (index, key, _), number in zip(tensors, numbers):
            read[index][key] = number
    return read
