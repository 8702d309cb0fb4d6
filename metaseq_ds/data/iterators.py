"""The resumable, rank-split batch iterator of the streaming LM task.

Samples (one epoch's stream, identical on every rank) are grouped into GLOBAL micro-batches
of batch_size * num_shards rows; rank `shard_id` takes rows [shard_id * batch_size,
(shard_id + 1) * batch_size). One rank with batch 8, two ranks with batch 4, and one rank
with batch 4 taking two micro-batches per update (--update-freq 2) therefore see the same
rows per update. Training drops the last incomplete global micro-batch of an epoch;
validation fills it up with empty rows, so every rank runs the same number of batches
(ranks must run forward in lockstep under ZeRO-3).

`EpochBatchIterator` keeps fairseq's interface (`next_epoch_itr`, `epoch`,
`iterations_in_epoch`, `end_of_epoch`, `state_dict`/`load_state_dict`). `RankBatches` makes
micro-batch j of a rank from the samples of its rows alone, read by index, so resuming at
batch j is a seek. `rank_rows` and `collated_batches` state the same split over a stream read
front to back: they are the definition `RankBatches` is tested against.
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from metaseq_ds.errors import UsageError

# A row of a rank's micro-batch: (sample id within the epoch, tokens or None for a filler row).
Row = Tuple[int, Optional[np.ndarray]]


class RankBatches:
    """One rank's collated micro-batches of one epoch, by number, from batch `first` on.

    Item k is micro-batch `first + k`: the rank's `batch_size` rows of that global micro-batch,
    each read from `samples` by index (ids past the end are filler rows when `fill_last`).
    A map-style dataset, so a torch DataLoader can spread the items over worker processes.
    """

    def __init__(
        self,
        samples: Sequence[np.ndarray],
        batch_size: int,
        num_shards: int,
        shard_id: int,
        fill_last: bool,
        collate: Callable[[List[Row]], Dict[str, Any]],
        first: int,
        what: str,
    ):
        if not 0 <= shard_id < num_shards:
            raise ValueError(f"shard_id {shard_id} is not in [0, {num_shards})")
        self.samples, self.collate = samples, collate
        self.batch_size, self.first = batch_size, first
        self.global_size = batch_size * num_shards
        self.offset = shard_id * batch_size
        count = len(samples) // self.global_size if not fill_last else -(-len(samples) // self.global_size)
        if count == 0:
            raise _no_full_batch(what)
        self.count = count

    def __len__(self) -> int:
        return max(self.count - self.first, 0)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = (self.first + index) * self.global_size + self.offset
        ids = range(start, start + self.batch_size)
        return self.collate([(i, self.samples[i] if i < len(self.samples) else None) for i in ids])


def rank_rows(
    samples: Iterator[np.ndarray], batch_size: int, num_shards: int, shard_id: int, fill_last: bool
) -> Iterator[List[Row]]:
    """This rank's rows of each global micro-batch, in order (see the module docstring)."""
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} is not in [0, {num_shards})")
    global_size = batch_size * num_shards
    first, last = shard_id * batch_size, (shard_id + 1) * batch_size
    group: List[np.ndarray] = []
    start = 0  # id of the group's first sample
    for sample in samples:
        group.append(sample)
        if len(group) == global_size:
            yield [(start + i, group[i]) for i in range(first, last)]
            group, start = [], start + global_size
    if group and fill_last:
        group += [None] * (global_size - len(group))
        yield [(start + i, group[i]) for i in range(first, last)]


class CountingIterator:
    """One epoch's batches; `n` counts those taken, `has_next()` looks one batch ahead."""

    def __init__(self, batches: Iterator[Any], start: int = 0):
        self.n = start
        self._batches = batches
        self._lookahead: List[Any] = []

    def __iter__(self) -> "CountingIterator":
        return self

    def __next__(self) -> Any:
        batch = self._lookahead.pop() if self._lookahead else next(self._batches)
        self.n += 1
        return batch

    def has_next(self) -> bool:
        if not self._lookahead:
            try:
                self._lookahead.append(next(self._batches))
            except StopIteration:
                return False
        return True


class EpochBatchIterator:
    """Batches of one rank over successive epochs, resumable mid-epoch.

    `batches_for_epoch(epoch, skip)` returns the iterator of the rank's collated batches of
    `epoch` after skipping the first `skip`; everything else is fairseq's bookkeeping.
    """

    def __init__(self, batches_for_epoch: Callable[[int, int], Iterator[Any]], epoch: int = 1):
        self.batches_for_epoch = batches_for_epoch
        self.epoch = max(epoch, 1)
        self._cur_epoch_itr: Optional[CountingIterator] = None
        self._next_epoch_itr: Optional[CountingIterator] = None

    @property
    def next_epoch_idx(self) -> int:
        """The epoch `next_epoch_itr` will return: this one if unstarted or resumed, else the next."""
        if self._next_epoch_itr is not None:
            return self.epoch
        if self._cur_epoch_itr is not None and self.end_of_epoch():
            return self.epoch + 1
        return self.epoch

    def next_epoch_itr(self, shuffle: bool = True, fix_batches_to_gpus: bool = False, set_dataset_epoch: bool = True) -> CountingIterator:
        """The iterator over the next epoch's batches (restarting the current epoch if it is unfinished).

        The keyword arguments are accepted for fairseq callers and have no effect: the task's
        split and seed fix the data order.
        """
        self.epoch = self.next_epoch_idx
        if self._next_epoch_itr is not None:
            self._cur_epoch_itr, self._next_epoch_itr = self._next_epoch_itr, None
        else:
            self._cur_epoch_itr = CountingIterator(self.batches_for_epoch(self.epoch, 0))
        return self._cur_epoch_itr

    def end_of_epoch(self) -> bool:
        return self._cur_epoch_itr is not None and not self._cur_epoch_itr.has_next()

    @property
    def iterations_in_epoch(self) -> int:
        if self._cur_epoch_itr is not None:
            return self._cur_epoch_itr.n
        if self._next_epoch_itr is not None:
            return self._next_epoch_itr.n
        return 0

    def state_dict(self) -> Dict[str, int]:
        if self.end_of_epoch():
            return {"epoch": self.epoch + 1, "iterations_in_epoch": 0}
        return {"epoch": self.epoch, "iterations_in_epoch": self.iterations_in_epoch}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        taken = state_dict.get("iterations_in_epoch", 0)
        self._cur_epoch_itr = None
        self._next_epoch_itr = CountingIterator(self.batches_for_epoch(self.epoch, taken), start=taken) if taken > 0 else None


def collated_batches(rows: Iterator[List[Row]], skip: int, collate: Callable[[List[Row]], Dict[str, Any]], what: str) -> Iterator[Dict[str, Any]]:
    """Collate the rank's rows after dropping the first `skip` micro-batches uncollated;
    a UsageError naming `what` (the split and epoch) if there is none at all."""
    produced = 0
    for index, batch_rows in enumerate(rows):
        produced += 1
        if index >= skip:
            yield collate(batch_rows)
    if produced == 0:
        raise _no_full_batch(what)


def _no_full_batch(what: str) -> UsageError:
    """An epoch that yields no batch at all would make training loop forever over empty epochs."""
    return UsageError(
        f"{what} yields no full micro-batch: it has fewer samples than --batch-size x ranks; "
        "use more data or a smaller --batch-size / --tokens-per-sample"
    )
