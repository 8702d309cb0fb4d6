"""The serving batcher's grouping rules, without a model: what may share a decoding batch."""

import threading

import pytest

from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.serving.batcher import Batcher, Done, Failed, Job

POSITIONS = 64


def _job(prompt_length=4, prompts=1, **options):
    return Job([[5] * prompt_length] * prompts, GenerationOptions(**options), POSITIONS, deliver=lambda event: None)


def _batches(batcher):
    out = []
    while batcher.waiting:
        out.append(batcher.next_batch())
    return out


def test_jobs_that_differ_only_in_their_limits_share_a_batch_in_arrival_order():
    batcher = Batcher(lambda jobs: None, max_batch_tokens=10_000)
    greedy = [_job(temperature=0, max_tokens=m, min_tokens=m // 2) for m in (3, 20, 7)]
    other = _job(temperature=0, max_tokens=3, logprobs=2)
    for job in (greedy[0], other, greedy[1], greedy[2]):
        batcher.submit(job)
    assert _batches(batcher) == [greedy, [other]]


def test_seeded_samples_are_drawn_in_batches_of_their_own():
    batcher = Batcher(lambda jobs: None, max_batch_tokens=10_000)
    seeded = [_job(temperature=0.7, seed=1), _job(temperature=0.7, seed=1)]
    unseeded = [_job(temperature=0.7), _job(temperature=0.7)]
    for job in seeded + unseeded:
        batcher.submit(job)
    assert _batches(batcher) == [[seeded[0]], [seeded[1]], unseeded]


def test_the_token_budget_counts_sequences_times_the_longest_prompt_plus_new_tokens():
    batcher = Batcher(lambda jobs: None, max_batch_tokens=200)
    jobs = [_job(prompt_length=10, prompts=2, temperature=0, max_tokens=20) for _ in range(5)]  # 2 x 30 each
    wide = _job(prompt_length=10, temperature=0, best_of=3, max_tokens=20)  # 3 beams x 30
    for job in jobs + [wide]:
        batcher.submit(job)
    assert [len(b) for b in _batches(batcher)] == [3, 2, 1]
    with pytest.raises(ValueError, match="needs 210 batch tokens"):
        batcher.submit(_job(prompt_length=10, prompts=7, temperature=0, max_tokens=20))  # 7 x 30 > 200


def test_a_long_prompt_does_not_take_the_positions_another_job_needs():
    batcher = Batcher(lambda jobs: None, max_batch_tokens=10_000)
    short = _job(prompt_length=4, temperature=0, max_tokens=40)  # needs 4 + 40 positions
    long = _job(prompt_length=50, temperature=0, max_tokens=8)  # left-padding it would leave 14 for `short`
    shorter = _job(prompt_length=3, temperature=0, max_tokens=10)
    for job in (short, long, shorter):
        batcher.submit(job)
    assert _batches(batcher) == [[short, shorter], [long]]


def test_the_worker_runs_batches_and_a_failed_batch_fails_only_its_jobs():
    events = {}
    ran = threading.Event()

    def run_batch(jobs):
        if not jobs:
            return
        if jobs[0].options.temperature == 0.5:
            raise RuntimeError("boom")
        for job in jobs:
            job.deliver(Done([[{"text": "ok"}]]))
        ran.set()

    batcher = Batcher(run_batch, max_batch_tokens=10_000, idle_seconds=0.05)
    bad = Job([[5]], GenerationOptions(temperature=0.5), POSITIONS, deliver=lambda e: events.setdefault("bad", e))
    good = Job([[5]], GenerationOptions(temperature=0), POSITIONS, deliver=lambda e: events.setdefault("good", e))
    batcher.submit(bad)
    batcher.submit(good)
    batcher.start()
    assert ran.wait(30)
    batcher.close()
    assert isinstance(events["bad"], Failed) and "RuntimeError: boom" in events["bad"].message
    assert events["good"] == Done([[{"text": "ok"}]])
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(_job())
