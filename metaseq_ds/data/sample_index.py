"""Sample i of epoch e, found by index in the token stores: the sample stream without reading it.

An epoch's documents, in the epoch's order (`document_order`: shuffled by seed and epoch for
training), concatenated, form one token stream; the cumulative lengths `doc_starts` place
every document in it. Every break mode of `document_blocks` cuts that stream into
contiguous spans of at most `block_size` tokens, so a sample is a span (start, end) and
reading it is a few slices of the memory-mapped store:

    none         spans [i*B, (i+1)*B); the last partial one only without drop_last
    eos_pad_8    each document cut at multiples of B; a piece of one token is skipped
    passthrough  each document of more than one token, its first B tokens
    complete     greedy packing of B-pieces of documents (one pass over the lengths; the only
                 mode where a span depends on all earlier documents)

The spans of an epoch are computed from the document lengths only (integers; no token is
read), so a resumed run seeks to its batch instead of replaying the epoch, and each rank
reads only the samples of its rows. `document_blocks` remains the definition: a test compares
both for every mode, seed, epoch and rank split.
"""

import threading
from collections import OrderedDict
from typing import Callable, Dict, List, Tuple

import numpy as np

from metaseq_ds.data.break_modes import BREAK_MODES, document_order
from metaseq_ds.data.token_store import TokenStore
from metaseq_ds.errors import UsageError

Spans = Tuple[np.ndarray, np.ndarray]  # starts and ends (int64) of the samples in the epoch's stream


class EpochSamples:
    """The samples of one epoch: `len()`, and `[i]` reads sample i (int64 tokens) from the store."""

    def __init__(self, store: TokenStore, order: np.ndarray, block_size: int, break_mode: str, drop_last: bool):
        self.store, self.order = store, order
        lengths = store.lengths[order]
        self.doc_starts = np.zeros(len(order) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self.doc_starts[1:])
        self.starts, self.ends = _SPANS[break_mode](lengths, self.doc_starts, block_size, drop_last)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read(int(self.starts[index]), int(self.ends[index]))

    def read(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the epoch's stream."""
        position = int(np.searchsorted(self.doc_starts, start, side="right")) - 1
        pieces = []
        while position < len(self.order) and self.doc_starts[position] < end:
            doc_start, doc_end = int(self.doc_starts[position]), int(self.doc_starts[position + 1])
            first = int(self.store.offsets[self.order[position]]) - doc_start  # stream position -> store index
            pieces.append(self.store.tokens[first + max(start, doc_start) : first + min(end, doc_end)])
            position += 1
        return np.concatenate(pieces).astype(np.int64)


class IndexedSamples:
    """The sample stream of one split, by index: its shards' token stores (epoch e reads shard
    (e-1) mod K), cut by the break mode. The task's dataset; see the module docstring."""

    def __init__(self, stores: List[TokenStore], block_size: int, break_mode: str, shuffle: bool, drop_last: bool):
        if break_mode not in BREAK_MODES:
            raise UsageError(f"--sample-break-mode: unknown mode {break_mode!r} (choose from {', '.join(BREAK_MODES)})")
        self.stores = stores
        self.block_size, self.break_mode = block_size, break_mode
        self.shuffle, self.drop_last = shuffle, drop_last
        self._recent: "OrderedDict[Tuple[int, int], EpochSamples]" = OrderedDict()
        self._lock = threading.Lock()  # prefetch threads of two iterators may ask at once

    def epoch(self, epoch: int, seed: int) -> EpochSamples:
        """Epoch `epoch`'s samples (the last two epochs' indexes are kept: validation asks again and again)."""
        key = (epoch, seed)
        with self._lock:
            if key not in self._recent:
                store = self.stores[(epoch - 1) % len(self.stores)]
                order = document_order(len(store), epoch, seed, self.shuffle)
                self._recent[key] = EpochSamples(store, order, self.block_size, self.break_mode, self.drop_last)
                while len(self._recent) > 2:
                    self._recent.popitem(last=False)
            return self._recent[key]


def _none_spans(lengths: np.ndarray, doc_starts: np.ndarray, block_size: int, drop_last: bool) -> Spans:
    total = int(doc_starts[-1])
    count = total // block_size if drop_last else -(-total // block_size)
    starts = np.arange(count, dtype=np.int64) * block_size
    return starts, np.minimum(starts + block_size, total)


def _eos_pad_8_spans(lengths: np.ndarray, doc_starts: np.ndarray, block_size: int, drop_last: bool) -> Spans:
    pieces = lengths // block_size + (lengths % block_size > 1)  # a last piece of one token is skipped
    doc = np.repeat(np.arange(len(lengths)), pieces)
    first_piece = np.cumsum(pieces) - pieces
    starts = doc_starts[doc] + (np.arange(len(doc)) - first_piece[doc]) * block_size
    return starts, np.minimum(starts + block_size, doc_starts[doc + 1])


def _passthrough_spans(lengths: np.ndarray, doc_starts: np.ndarray, block_size: int, drop_last: bool) -> Spans:
    doc = np.flatnonzero(lengths > 1)
    return doc_starts[doc], doc_starts[doc] + np.minimum(lengths[doc], block_size)


def _complete_spans(lengths: np.ndarray, doc_starts: np.ndarray, block_size: int, drop_last: bool) -> Spans:
    """Greedy packing as `document_blocks` does it: pieces of at most B tokens join the open block
    while they fit; a full piece (a long document's) always fills a block of its own."""
    boundaries = [0]
    fill = position = 0
    for length in lengths.tolist():
        if length < block_size:  # one piece
            if fill + length > block_size:
                boundaries.append(position)
                fill = 0
            fill += length
        else:
            full, rest = divmod(length, block_size)
            if fill:
                boundaries.append(position)
            boundaries.extend(range(position + block_size, position + full * block_size, block_size))
            if rest:
                boundaries.append(position + full * block_size)
            fill = rest or block_size
        position += length
    boundaries.append(position)
    edges = np.array(boundaries, dtype=np.int64)
    return edges[:-1], edges[1:]


_SPANS: Dict[str, Callable[[np.ndarray, np.ndarray, int, bool], Spans]] = {
    "none": _none_spans,
    "complete": _complete_spans,
    "eos_pad_8": _eos_pad_8_spans,
    "passthrough": _passthrough_spans,
}
