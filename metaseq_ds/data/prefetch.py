"""Batches prepared off the training step's critical path (metaseq's `--num-workers`,
`--data-buffer-size`).

    num_workers == 0   a background thread of the training process fills a queue of
                       `buffer_size` batches (reading a sample is a few slices of a memory
                       map and collating is a tensor copy: a thread keeps ahead of any step)
    num_workers  > 0   a torch DataLoader with that many worker processes, each keeping
                       about buffer_size / num_workers batches ready (for expensive
                       collation in plugin tasks)
    buffer_size == 0   no background work: each batch is made when the step asks for it

The batches and their order are the same in all three ways.

A background thread is stopped and joined when the process exits (`_stop_threads`, at exit),
not left to the interpreter's finalisation: there, a daemon thread coming back from torch's C++
code (which runs without the GIL) is ended by `pthread_exit`, whose unwinding through C++
frames calls std::terminate: "terminate called without an active exception" and exit 134 after
a run that succeeded (seen at the end of the demo, with a validation split's thread still
making batches the run no longer wanted).
"""

import atexit
import queue
import threading
from typing import Any, Callable, Iterator, Set, Sized, Tuple

import torch

from metaseq_ds.data.iterators import RankBatches
from metaseq_ds.device import pin


def background_batches(make_batches: Callable[[], RankBatches], num_workers: int, buffer_size: int) -> Iterator[Any]:
    """Iterate the batches `make_batches()` returns; it is called when the first batch is
    wanted (in the thread, for the thread), so creating an epoch's iterator costs nothing."""
    if num_workers > 0:
        return _worker_processes(make_batches, num_workers, max(buffer_size, num_workers))
    if buffer_size > 0:
        return _thread(make_batches, buffer_size)
    return _in_order(make_batches)


def _in_order(make_batches: Callable[[], RankBatches]) -> Iterator[Any]:
    batches = make_batches()
    for index in range(len(batches)):
        yield batches[index]


def _worker_processes(make_batches: Callable[[], Sized], num_workers: int, buffer_size: int) -> Iterator[Any]:
    batches = make_batches()
    yield from torch.utils.data.DataLoader(
        batches, batch_size=None, shuffle=False, num_workers=num_workers, prefetch_factor=-(-buffer_size // num_workers),
        pin_memory=torch.cuda.is_available(),
    )


_END = object()
_LIVE: Set[Tuple[threading.Thread, threading.Event]] = set()  # running batch threads and their stop events


@atexit.register
def _stop_threads() -> None:
    """Stop every batch thread and wait for it (it finishes the batch it is making, then sees the
    stop event): no thread is inside torch when the interpreter finalises (module docstring)."""
    for _, stop in list(_LIVE):
        stop.set()
    for thread, _ in list(_LIVE):
        thread.join(timeout=30)


def _thread(make_batches: Callable[[], RankBatches], buffer_size: int) -> Iterator[Any]:
    ready: "queue.Queue" = queue.Queue(buffer_size)
    stop = threading.Event()  # set when the consumer is gone: the thread must not wait forever

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fill() -> None:
        try:
            for batch in _in_order(make_batches):
                if not put((pin(batch), None)):  # on CUDA: page-locked, so its copy overlaps the step
                    return
            put((_END, None))
        except BaseException as error:  # raised in the consumer, where the run can report it
            put((None, error))
        finally:
            _LIVE.discard((thread, stop))

    thread = threading.Thread(target=fill, name="metaseq_ds batch prefetch", daemon=True)
    _LIVE.add((thread, stop))
    thread.start()
    try:
        while True:
            batch, error = ready.get()
            if error is not None:
                raise error
            if batch is _END:
                return
            yield batch
    finally:
        stop.set()
