"""Continuous batching (`serving.continuous.ContinuousBatcher`) on a tiny model: requests join
the running batch at the next step and leave when done, in arrival order; each gets exactly what
`GeneratorInterface.generate` gives it alone (greedy, seeded sampling, logprobs, echo, long
prompts prefilled in chunks); cancelled requests stop within a step; beam search waits for the
running requests, then decodes alone."""

import threading
import time

import pytest

from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.serving.batcher import Done, Failed, Job, Token
from metaseq_ds.serving.continuous import ContinuousBatcher
from serving import POSITIONS, slow_steps, wait_until, write_checkpoint

TEXTS = ["the model", "loss of the data and more", "weights", "a batch of words"]


@pytest.fixture(scope="module")
def interface(tmp_path_factory):
    from metaseq_ds.hub_utils import GeneratorInterface

    interface = GeneratorInterface(str(write_checkpoint(tmp_path_factory.mktemp("continuous") / "ckpt")))
    interface.load_model()
    return interface


class Events:
    """What a job's requester receives, with the time each event came."""

    def __init__(self):
        self.items = []
        self.done = threading.Event()

    def __call__(self, event):
        self.items.append((time.monotonic(), event))
        if isinstance(event, (Done, Failed)):
            self.done.set()

    @property
    def tokens(self):
        return [e.token for _, e in self.items if isinstance(e, Token)]

    @property
    def result(self):
        assert self.done.wait(120)
        return self.items[-1][1]


def _job(interface, texts, **options):
    events = Events()
    prompts = [interface.encode(text, i) for i, text in enumerate(texts)]
    return Job(prompts, GenerationOptions(**options), POSITIONS, events), events


def _alone(interface, texts, **options):
    return interface.generate(texts, options=GenerationOptions(**options))


def _assert_same_results(got, expected):
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert [r["text"] for r in mine] == [r["text"] for r in theirs]
        assert [r["tokens"] for r in mine] == [r["tokens"] for r in theirs]
        assert [r["finish_reason"] for r in mine] == [r["finish_reason"] for r in theirs]
        for a, b in zip(mine, theirs):
            assert [s is None for s in a["token_scores"]] == [s is None for s in b["token_scores"]]
            assert [s for s in a["token_scores"] if s is not None] == \
                pytest.approx([s for s in b["token_scores"] if s is not None], abs=1e-4)
            assert (a["top_logprobs"] is None) == (b["top_logprobs"] is None)
            for x, y in zip(a["top_logprobs"] or [], b["top_logprobs"] or []):
                assert (x is None) == (y is None) and (x is None or x == pytest.approx(y, abs=1e-4))


def test_a_request_joins_the_running_batch_at_the_next_step_and_leaves_when_done(interface, monkeypatch):
    batcher = ContinuousBatcher(interface, max_batch_tokens=4 * POSITIONS)
    slow_steps(monkeypatch, batcher)
    batcher.start()
    try:
        long, long_events = _job(interface, TEXTS[:1], temperature=0, max_tokens=40, min_tokens=40)
        batcher.submit(long)
        wait_until(lambda: len(long_events.tokens) >= 5)
        short, short_events = _job(interface, TEXTS[1:2], temperature=0, max_tokens=3)
        batcher.submit(short)
        submitted_at = len(long_events.tokens)
        short_result = short_events.result
        first_short = next(t for t, e in short_events.items if isinstance(e, Token))
        # It joined at the next step or the one after (a prefill, then a step), and finished
        # while the long one still ran.
        assert sum(1 for t, e in long_events.items if isinstance(e, Token) and t < first_short) <= submitted_at + 2
        assert len(long_events.tokens) < 40 and not long_events.done.is_set()
        _assert_same_results(short_result.results, _alone(interface, TEXTS[1:2], temperature=0, max_tokens=3))
        _assert_same_results(long_events.result.results,
                             _alone(interface, TEXTS[:1], temperature=0, max_tokens=40, min_tokens=40))
        assert batcher.free == list(range(batcher.slots))  # every slot back
    finally:
        batcher.close()


REQUESTS = {
    "greedy_min_tokens_and_stop": (TEXTS[:1], dict(temperature=0, max_tokens=20, min_tokens=5, stop=["e", 101])),
    "seeded_sampling": (TEXTS[:2], dict(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=12)),
    "best_of_samples": (TEXTS[2:3], dict(temperature=1.0, best_of=3, n=2, seed=5, max_tokens=8)),
    "logprobs": (TEXTS[:2], dict(temperature=0, max_tokens=8, logprobs=3)),
    "scoring_as_lm_eval_asks": (TEXTS[1:4], dict(temperature=0, max_tokens=1, echo=True, logprobs=1)),
    "long_prompt_echo": (["word " * 11], dict(temperature=0, max_tokens=4, echo=True, logprobs=2)),
    "four_prompts": (TEXTS, dict(temperature=0, max_tokens=10)),
}


@pytest.mark.parametrize("prefill_tokens", [512, 7], ids=["whole_prompts", "chunks_of_7"])
def test_every_request_gets_what_it_gets_alone_whatever_shares_its_steps(interface, prefill_tokens):
    batcher = ContinuousBatcher(interface, max_batch_tokens=16 * POSITIONS, prefill_tokens=prefill_tokens)
    jobs = {name: _job(interface, texts, **options) for name, (texts, options) in REQUESTS.items()}
    for job, _ in jobs.values():  # all queued before the worker starts: they share their steps
        batcher.submit(job)
    batcher.start()
    try:
        for name, (texts, options) in REQUESTS.items():
            result = jobs[name][1].result
            assert isinstance(result, Done), result
            _assert_same_results(result.results, _alone(interface, texts, **options))
    finally:
        batcher.close()


def test_a_cancelled_request_stops_within_a_step_and_gives_its_slots_back(interface, monkeypatch):
    batcher = ContinuousBatcher(interface, max_batch_tokens=4 * POSITIONS)
    slow_steps(monkeypatch, batcher)
    batcher.start()
    try:
        job, events = _job(interface, TEXTS[:2], temperature=0, max_tokens=50, min_tokens=50)
        batcher.submit(job)
        wait_until(lambda: len(events.tokens) >= 4)
        job.cancel()
        batcher.wake()
        seen = len(events.tokens)
        wait_until(lambda: not batcher.requests)
        time.sleep(0.1)
        assert len(events.tokens) <= seen + 2  # the step under way (one token per prompt) at most
        assert not events.done.is_set()  # nobody to answer
        assert batcher.free == list(range(batcher.slots))
        after, after_events = _job(interface, TEXTS[2:3], temperature=0, max_tokens=5)
        batcher.submit(after)
        _assert_same_results(after_events.result.results, _alone(interface, TEXTS[2:3], temperature=0, max_tokens=5))
    finally:
        batcher.close()


def test_a_request_past_its_timeout_stops_with_504(interface, monkeypatch):
    batcher = ContinuousBatcher(interface, max_batch_tokens=4 * POSITIONS)
    slow_steps(monkeypatch, batcher)
    batcher.start()
    try:
        job, events = _job(interface, TEXTS[:1], temperature=0, max_tokens=50, min_tokens=50)
        job.timeout = 0.2
        batcher.submit(job)
        failed = events.result
        assert isinstance(failed, Failed) and failed.status == 504 and "--request-timeout of 0.2 s" in failed.message
        assert len(events.tokens) < 50
        wait_until(lambda: not batcher.requests)
        assert batcher.free == list(range(batcher.slots))
    finally:
        batcher.close()


def test_requests_wait_in_order_for_free_slots_and_beam_search_decodes_alone(interface, monkeypatch):
    batcher = ContinuousBatcher(interface, max_batch_tokens=2 * POSITIONS)  # 2 slots
    slow_steps(monkeypatch, batcher, delay=0.005)
    first, first_events = _job(interface, TEXTS[:2], temperature=0, max_tokens=10)  # both slots
    beam, beam_events = _job(interface, TEXTS[2:3], temperature=0, best_of=2, n=2, max_tokens=6)
    last, last_events = _job(interface, TEXTS[3:4], temperature=0, max_tokens=4)  # a slot would be free for it
    for job in (first, beam, last):
        batcher.submit(job)
    batcher.start()
    try:
        for events in (first_events, beam_events, last_events):
            assert isinstance(events.result, Done)
        ends = [events.items[-1][0] for events in (first_events, beam_events, last_events)]
        starts = [events.items[0][0] for events in (beam_events, last_events)]
        assert ends[0] <= starts[0] and ends[1] <= starts[1]  # arrival order kept; the beams alone
        _assert_same_results(beam_events.result.results,
                             _alone(interface, TEXTS[2:3], temperature=0, best_of=2, n=2, max_tokens=6))
    finally:
        batcher.close()


def test_a_fault_fails_the_running_requests_and_the_worker_goes_on(interface, monkeypatch):
    batcher = ContinuousBatcher(interface, max_batch_tokens=4 * POSITIONS)
    step = batcher.decoding.step

    def broken(*args, **kwargs):
        monkeypatch.setattr(batcher.decoding, "step", step)  # once
        raise RuntimeError("device lost")

    monkeypatch.setattr(batcher.decoding, "step", broken)
    job, events = _job(interface, TEXTS[:1], temperature=0, max_tokens=5)
    batcher.submit(job)
    batcher.start()
    try:
        failed = events.result
        assert isinstance(failed, Failed) and failed.status == 500 and "RuntimeError: device lost" in failed.message
        again, again_events = _job(interface, TEXTS[:1], temperature=0, max_tokens=5)
        batcher.submit(again)
        _assert_same_results(again_events.result.results, _alone(interface, TEXTS[:1], temperature=0, max_tokens=5))
    finally:
        batcher.close()


def test_the_cache_is_allocated_once_for_the_token_budget(interface):
    batcher = ContinuousBatcher(interface, max_batch_tokens=5 * POSITIONS, max_model_len=32)
    assert batcher.positions == 32
    assert batcher.slots * batcher.cache.capacity <= 5 * POSITIONS
    job, _ = _job(interface, ["x" * 40], temperature=0, max_tokens=2)
    assert "no room" in batcher.refusal(job)[1] and "--max-model-len" in batcher.refusal(job)[1]
    wide, _ = _job(interface, TEXTS * 5, temperature=0, max_tokens=2)
    assert "20 sequences" in batcher.refusal(wide)[1]


def test_the_compiled_step_serves_the_same_tokens_with_a_graph_per_window_compiled_at_start(tmp_path):
    from torch._dynamo.utils import counters

    from convert_helpers import TINY_MODEL, write_zero0_checkpoint
    from metaseq_ds.hub_utils import GeneratorInterface

    write_zero0_checkpoint(tmp_path / "ckpt", [flag if flag != "16" else "256" for flag in TINY_MODEL])  # 256 positions
    interface = GeneratorInterface(str(tmp_path / "ckpt"))
    interface.load_model()
    compiled = GeneratorInterface(model=interface.model, task=interface.task, compile=True)
    batcher = ContinuousBatcher(compiled, max_batch_tokens=8 * 128, max_model_len=128)  # reads 64 or 128
    assert batcher.decoding.compiled and batcher.cache.capacity == 128
    requests = {name: REQUESTS[name] for name in ("greedy_min_tokens_and_stop", "seeded_sampling", "logprobs")}
    requests["past_64_positions"] = (["word " * 11], dict(temperature=0, max_tokens=10))  # 56 + 10 positions
    jobs = {name: _job(compiled, texts, **options) for name, (texts, options) in requests.items()}
    counters.clear()
    batcher.start()  # compiles every window before the first request: none stalls the running ones later
    assert batcher.windows() == [64, 128] and counters["stats"]["unique_graphs"] == 2
    for job, _ in jobs.values():
        batcher.submit(job)
    try:
        for name, (texts, options) in requests.items():
            _assert_same_results(jobs[name][1].result.results, _alone(interface, texts, **options))
    finally:
        batcher.close()
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
