"""Requests as `Job`s, the events a job's requester receives, and the static batcher
(`mseq serve --batching static`, and every launch of several ranks): requests waiting to be
decoded are grouped into one decoding batch under a token budget, and batches run one at a time
on a thread of their own. (`continuous.ContinuousBatcher` is the default: it schedules per step.)

Static batching: a request that arrives while a batch decodes waits for the next batch (it does
not join the running one at its next step). When the worker is free it takes the oldest waiting
job and, in arrival order (with `one_at_a_time`, only that job), every other waiting job that

- has the same generation options but for `max_tokens`/`min_tokens` (each prompt keeps its own
  limits in the batch; `SequenceGenerator` decodes them together);
- is not seeded sampling: a seeded sample is drawn in a batch of its own, so that its tokens do
  not depend on what else was waiting (they equal `mseq generate`'s with the same seed);
- keeps the batch within `max_batch_tokens`, counted as the KV cache holds them: sequences
  (prompts x best_of) x (the longest prompt + the most new tokens);
- fits the model's positions: prompts are left-padded to the longest, so a long prompt must not
  take the room another job's new tokens need.
Jobs that do not fit stay queued, in order, for the next batch. A job cancelled (its client went
away) or past its deadline while it waits never runs.
"""

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from metaseq_ds.generation_options import GenerationOptions

logger = logging.getLogger("metaseq_ds.serving")

LIMITS = {"min_tokens", "max_tokens"}


@dataclass(frozen=True)
class Token:
    """A token chosen for prompt `prompt` of a job (greedy or sampling with best_of 1 only)."""

    prompt: int
    token: int


@dataclass(frozen=True)
class Done:
    """The job's results: per prompt, `GeneratorInterface.generate`'s `n` result dicts."""

    results: List[List[dict]]


@dataclass(frozen=True)
class Failed:
    """The job did not complete: one line, and the HTTP status to answer (500: a server fault,
    not the request's; 504: it ran past the server's request timeout)."""

    message: str
    status: int = 500


class QueueFull(Exception):
    """The batcher's queue holds `--max-queued-requests` jobs already (HTTP 429)."""


@dataclass(eq=False)
class Job:
    """Prompts (token ids) of one request with its options. `deliver` is called from the
    worker thread with each `Token` (if `stream_tokens`), then one `Done` or `Failed`."""

    prompts: List[List[int]]
    options: GenerationOptions
    positions: int  # the model's
    deliver: Callable[[Any], None]
    stream_tokens: bool = False
    timeout: Optional[float] = None  # seconds from arrival; None: no limit
    key: Any = field(init=False)
    arrived: float = field(init=False, default_factory=time.monotonic)
    first_token_at: Optional[float] = field(init=False, default=None)
    last_token_at: Optional[float] = field(init=False, default=None)
    cancelled: bool = field(init=False, default=False)
    finished: bool = field(init=False, default=False)  # its Done or Failed was delivered

    def __post_init__(self):
        seeded_sample = self.options.temperature > 0 and self.options.seed is not None
        # Jobs of equal keys may share a batch.
        self.key = id(self) if seeded_sample else self.options.model_dump(exclude=LIMITS)

    def cancel(self) -> None:
        """The requester is gone: drop the job at the batcher's next step (a flag: set from any thread)."""
        self.cancelled = True

    def expired(self, now: float) -> bool:
        return self.timeout is not None and now - self.arrived > self.timeout

    def timed_out(self) -> Failed:
        return Failed(f"the request ran past this server's --request-timeout of {self.timeout:g} s", status=504)

    @property
    def rows(self) -> int:
        """Sequences decoded for this job: best_of beams or samples per prompt."""
        return len(self.prompts) * self.options.best_of

    @property
    def prompt_length(self) -> int:
        return max(len(p) for p in self.prompts)

    @property
    def new_tokens(self) -> int:
        """At most this many new tokens: max_tokens, or up to the model's last position."""
        return min(self.options.max_tokens, self.positions - self.prompt_length)

    @property
    def batch_tokens(self) -> int:
        """What this job alone takes of the budget."""
        return batch_tokens([self])


def batch_tokens(jobs: List[Job]) -> int:
    """KV cache positions of a batch: its sequences x (longest prompt + most new tokens)."""
    return sum(j.rows for j in jobs) * (max(j.prompt_length for j in jobs) + max(j.new_tokens for j in jobs))


def fits(jobs: List[Job], max_batch_tokens: int) -> bool:
    """Within the budget, and every job's new tokens fit after the batch's longest prompt."""
    longest = max(j.prompt_length for j in jobs)
    return batch_tokens(jobs) <= max_batch_tokens and all(longest + j.new_tokens <= j.positions for j in jobs)


class JobQueue:
    """The waiting side shared by both batchers: a bounded FIFO of jobs, fed from the server's
    threads and drained by one worker thread; cancelled and expired jobs are dropped from it."""

    def __init__(self, max_queued: Optional[int], metrics=None):
        self.max_queued = max_queued
        self.metrics = metrics  # serving.metrics.ServerMetrics: its gauges follow the queue
        self.waiting: List[Job] = []
        self.running = 0  # jobs being decoded (the worker's count)
        self.closed = False
        self.changed = threading.Condition()

    def refusal(self, job: Job) -> Optional[Tuple[str, str]]:
        """Why this batcher can never run `job`: (the request field to blame, a one-line reason), or None."""
        raise NotImplementedError

    def submit(self, job: Job) -> None:
        """Queue `job`; `QueueFull` when `max_queued` wait already, `RuntimeError` once closed."""
        refused = self.refusal(job)
        if refused:  # the server checks requests before this
            raise ValueError(refused[1])
        with self.changed:
            if self.closed:
                raise RuntimeError("the batcher is closed")
            if self.max_queued is not None and len(self.waiting) >= self.max_queued:
                raise QueueFull(f"{len(self.waiting)} requests are queued, this server's --max-queued-requests")
            self.waiting.append(job)
            self._gauges()
            self.changed.notify()

    def wake(self) -> None:
        """Let the worker look at the queue now (a job was cancelled)."""
        with self.changed:
            self.changed.notify()

    def close(self) -> None:
        """Finish what is queued and running, then stop the worker."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join()

    def _drop_gone(self) -> None:
        """Under `changed`: drop waiting jobs that were cancelled or ran past their deadline."""
        now = time.monotonic()
        for job in [job for job in self.waiting if job.cancelled or job.expired(now)]:
            self.waiting.remove(job)
            if not job.cancelled:
                job.deliver(job.timed_out())

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(len(self.waiting))
            self.metrics.running.set(self.running)


class Batcher(JobQueue):
    """Queues jobs and runs `run_batch(jobs)` on a worker thread, one batch at a time.

    While nothing waits, `run_batch([])` is called every `idle_seconds` (the sharded runner
    sends the other ranks a heartbeat: their collectives time out otherwise)."""

    def __init__(self, run_batch: Callable[[List[Job]], None], max_batch_tokens: int, idle_seconds: float = 60.0,
                 one_at_a_time: bool = False, max_queued: Optional[int] = None, metrics=None):
        super().__init__(max_queued, metrics)
        self.run_batch = run_batch
        self.max_batch_tokens = max_batch_tokens
        self.idle_seconds = idle_seconds
        self.one_at_a_time = one_at_a_time
        self.thread = threading.Thread(target=self._work, name="mseq-serve-batcher", daemon=True)

    def start(self) -> "Batcher":
        self.thread.start()
        return self

    def refusal(self, job: Job) -> Optional[Tuple[str, str]]:
        if job.batch_tokens <= self.max_batch_tokens:
            return None
        return "max_tokens", (f"the request needs {job.batch_tokens} batch tokens ({job.rows} sequences of up to "
                f"{job.prompt_length} + {job.new_tokens} tokens); this server decodes at most "
                f"{self.max_batch_tokens} per batch (--max-batch-tokens): lower max_tokens, n, best_of or "
                "the number of prompts")

    def next_batch(self) -> Optional[List[Job]]:
        """The jobs of the next batch ([] after `idle_seconds` with nothing waiting), None once
        closed and drained."""
        with self.changed:
            self._drop_gone()
            if not self.waiting and not self.closed:
                self.changed.wait(self.idle_seconds)
                self._drop_gone()
            if not self.waiting:
                self._gauges()
                return None if self.closed else []
            batch: List[Job] = [self.waiting[0]]
            for job in self.waiting[1:] if not self.one_at_a_time else ():
                if job.key == batch[0].key and fits(batch + [job], self.max_batch_tokens):
                    batch.append(job)
            self.waiting = [job for job in self.waiting if job not in batch]
            self.running = len(batch)
            self._gauges()
            return batch

    def _work(self) -> None:
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            try:
                self.run_batch(batch)
            except Exception as error:  # a fault of the server: the jobs fail, the worker goes on
                logger.exception("decoding a batch of %d requests failed", len(batch))
                for job in batch:
                    job.deliver(Failed(f"the server failed to decode this request ({type(error).__name__}: {error})"))
            with self.changed:
                self.running = 0
                self._gauges()
