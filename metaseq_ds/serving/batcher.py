"""The batching worker: requests waiting to be decoded are grouped into one decoding batch under
a token budget, and batches run one at a time on a thread of their own.

Static batching: a request that arrives while a batch decodes waits for the next batch (it does
not join the running one at its next step). When the worker is free it takes the oldest waiting
job and, in arrival order, every other waiting job that

- has the same generation options but for `max_tokens`/`min_tokens` (each prompt keeps its own
  limits in the batch; `SequenceGenerator` decodes them together);
- is not seeded sampling: a seeded sample is drawn in a batch of its own, so that its tokens do
  not depend on what else was waiting (they equal `mseq generate`'s with the same seed);
- keeps the batch within `max_batch_tokens`, counted as the KV cache holds them: sequences
  (prompts x best_of) x (the longest prompt + the most new tokens);
- fits the model's positions: prompts are left-padded to the longest, so a long prompt must not
  take the room another job's new tokens need.
Jobs that do not fit stay queued, in order, for the next batch.
"""

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

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
    """The batch of the job failed (a server fault, not the request's): one line."""

    message: str


@dataclass(eq=False)
class Job:
    """Prompts (token ids) of one request with its options. `deliver` is called from the
    worker thread with each `Token` (if `stream_tokens`), then one `Done` or `Failed`."""

    prompts: List[List[int]]
    options: GenerationOptions
    positions: int  # the model's
    deliver: Callable[[Any], None]
    stream_tokens: bool = False
    key: Any = field(init=False)

    def __post_init__(self):
        seeded_sample = self.options.temperature > 0 and self.options.seed is not None
        # Jobs of equal keys may share a batch.
        self.key = id(self) if seeded_sample else self.options.model_dump(exclude=LIMITS)

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


class Batcher:
    """Queues jobs and runs `run_batch(jobs)` on a worker thread, one batch at a time.

    While nothing waits, `run_batch([])` is called every `idle_seconds` (the sharded runner
    sends the other ranks a heartbeat: their collectives time out otherwise)."""

    def __init__(self, run_batch: Callable[[List[Job]], None], max_batch_tokens: int, idle_seconds: float = 60.0):
        self.run_batch = run_batch
        self.max_batch_tokens = max_batch_tokens
        self.idle_seconds = idle_seconds
        self.waiting: List[Job] = []
        self.closed = False
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._work, name="mseq-serve-batcher", daemon=True)

    def start(self) -> "Batcher":
        self.thread.start()
        return self

    def submit(self, job: Job) -> None:
        if job.batch_tokens > self.max_batch_tokens:  # the server checks requests before this
            raise ValueError(f"a job of {job.batch_tokens} batch tokens can never run under {self.max_batch_tokens}")
        with self.changed:
            if self.closed:
                raise RuntimeError("the batcher is closed")
            self.waiting.append(job)
            self.changed.notify()

    def close(self) -> None:
        """Finish what is queued, then stop the worker."""
        with self.changed:
            self.closed = True
            self.changed.notify()
        self.thread.join()

    def next_batch(self) -> Optional[List[Job]]:
        """The jobs of the next batch ([] after `idle_seconds` with nothing waiting), None once
        closed and drained."""
        with self.changed:
            if not self.waiting and not self.closed:
                self.changed.wait(self.idle_seconds)
            if not self.waiting:
                return None if self.closed else []
            batch: List[Job] = []
            for job in self.waiting:
                if job.key == self.waiting[0].key and fits(batch + [job], self.max_batch_tokens):
                    batch.append(job)
            self.waiting = [job for job in self.waiting if job not in batch]
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
