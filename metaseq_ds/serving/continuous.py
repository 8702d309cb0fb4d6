"""Continuous (iteration-level) batching, `mseq serve`'s default: requests join and leave the
running batch at every decoding step, on one `StaticKVCache` allocated at start-up.

The cache has `slots` rows of `capacity` positions (`--max-batch-tokens` / `--max-model-len`).
A request takes one slot per sequence (prompts x best_of samples) and gives them back as each
sequence ends; nothing is concatenated or re-padded while others decode. Each turn of the
worker thread:

1. drops cancelled requests (their client went away) and those past `--request-timeout`;
2. admits waiting requests, oldest first, while slots are free (a request that does not fit
   waits, and so do those behind it: arrival order is kept);
3. prefills at most `prefill_tokens` prompt tokens, oldest first, into their slots: a long
   prompt goes in chunks over several turns, so the running sequences are not stalled behind
   it (with `echo`, the prompt's log-probabilities are taken from each chunk);
4. runs one decoding step over every slot (`StaticDecoding.step`: compiled, one fixed shape
   per window of positions, all compiled at `start`, before the first request) and chooses
   each request's tokens.

Results equal `mseq generate`'s for the same request alone: tokens are chosen by the same
`SequenceGenerator` rules (bans, min/max tokens, stop tokens and strings, logprobs, echo), and
each sampling request draws from its own generator, seeded as `mseq generate` seeds it, for its
own sequences only; a request's sequences start decoding together, once all are prefilled, so
its draws come in the same order. What shares the step with it does not change its tokens.

Beam search (temperature 0, best_of > 1) keeps the incremental path: such a request waits until
the running ones have finished (new ones are not admitted past it), then decodes alone.
"""

import logging
import threading
import time
from typing import List, Optional, Tuple

import torch

from metaseq_ds import static_decoding
from metaseq_ds.hub_utils import TextIds
from metaseq_ds.sequence_generator import SequenceGenerator
from metaseq_ds.serving.batcher import Done, Failed, Job, JobQueue, Token

logger = logging.getLogger("metaseq_ds.serving")

PREFILL_TOKENS = 512  # prompt tokens (padded) per turn: a long prompt delays the running ones at most this much


class Sequence:
    """One sequence of a request in its cache slot: a prompt, and what was chosen after it."""

    def __init__(self, request: "Request", prompt_index: int, prompt: List[int]):
        self.request, self.prompt_index, self.prompt = request, prompt_index, prompt
        self.slot: Optional[int] = None
        self.filled = 0  # prompt positions written to the cache so far
        self.next_lprobs: Optional[torch.Tensor] = None  # (V,) after the prompt's last position
        self.new_tokens: List[int] = []
        self.scores: List[float] = []
        self.tops: list = []  # per new token: (values, ids) of the `logprobs` most likely
        self.prompt_scores: List[torch.Tensor] = []  # with echo: per chunk
        self.prompt_tops: List[torch.Tensor] = []
        self.reason: Optional[str] = None

    @property
    def prefilled(self) -> bool:
        return self.filled == len(self.prompt)

    @property
    def position(self) -> int:
        """Where the last chosen token goes in the cache (the next step's input)."""
        return len(self.prompt) + len(self.new_tokens) - 1


class Request:
    """A job being decoded: its sequences, limits and, when sampling, its own generator."""

    def __init__(self, job: Job, generator: SequenceGenerator, positions: int, device: torch.device):
        self.job, self.generator = job, generator
        options = job.options
        self.sequences = [Sequence(self, index, prompt) for index, prompt in enumerate(job.prompts)
                          for _ in range(options.samples)]
        self.min_tokens = options.min_tokens
        # As `SequenceGenerator.generate` limits a batch: by the room after its longest prompt.
        self.max_tokens = min(options.max_tokens, positions - job.prompt_length)
        self.rng = generator.sampling_generator(device) if options.temperature > 0 else None
        self.step = -1  # the index of the token being chosen; -1 until every sequence is prefilled
        ends = [generator.eos, *generator.stop.single_tokens]
        self.extra_ends = torch.tensor(ends, device=device) if len(ends) > 1 else None

    @property
    def going(self) -> List[Sequence]:
        return [s for s in self.sequences if s.reason is None]


class ContinuousBatcher(JobQueue):
    """Schedules jobs per decoding step on one model (see the module's docstring)."""

    def __init__(self, interface, max_batch_tokens: int, max_model_len: Optional[int] = None,
                 max_queued: Optional[int] = None, metrics=None, prefill_tokens: int = PREFILL_TOKENS):
        super().__init__(max_queued, metrics)
        self.interface = interface
        model = interface.model
        self.decoder = model.decoder if hasattr(model, "decoder") else model
        self.device = next(model.parameters()).device
        self.positions = min(max_model_len or self.decoder.max_positions(), self.decoder.max_positions())
        self.decoding = static_decoding.StaticDecoding.of(
            self.decoder, compile=static_decoding.should_compile(interface.compile, self.device))
        capacity = self.decoding.buckets(1, self.positions)[1]
        slots = max(1, max_batch_tokens // capacity)
        if self.decoding.compiled:  # a power of two, as buckets go, but down: within the budget
            slots = 1 << (slots.bit_length() - 1)
        self.cache = self.decoding.cache(slots, self.positions)
        self.slots = self.cache.slots
        self.max_batch_tokens = max_batch_tokens
        self.prefill_tokens = prefill_tokens
        dictionary = interface.dictionary
        self.pad, self.eos = dictionary.pad(), dictionary.eos()
        self.banned = torch.tensor([self.pad], device=self.device)
        self.end_tokens = torch.tensor([self.eos], device=self.device)
        self.requests: List[Request] = []  # admitted, in arrival order
        self.free = list(range(self.slots))
        self.thread = threading.Thread(target=self._work, name="mseq-serve-scheduler", daemon=True)
        self.ready = threading.Event()  # set once the worker has compiled the step (or failed to start)
        self.start_error: Optional[BaseException] = None

    def start(self) -> "ContinuousBatcher":
        """Starts the worker and returns once it is ready to decode (compiled, where it compiles)."""
        self.thread.start()
        self.ready.wait()
        if self.start_error is not None:
            raise self.start_error
        return self

    def windows(self) -> List[int]:
        """The positions a compiled step may read (`_step`'s buckets up to the cache's capacity):
        a graph each."""
        lengths, n = set(), 1
        while n < self.cache.capacity:
            lengths.add(self.decoding.buckets(1, n)[1])
            n *= 2
        return sorted(lengths | {self.cache.capacity})

    @torch.no_grad()
    def _compile_windows(self) -> None:
        """Compile (on CUDA: also record the CUDA graph of) the step of every window now, before
        the first request: met later, a new window would stall every running sequence for its
        compilation (tens of seconds for a large model). On the worker's thread, which replays
        them: CUDA graph trees are per thread. Twice each, as CUDA graph trees warm a graph up
        before they record it. The pads written at position 0 are cleared after."""
        started = time.perf_counter()
        tokens = torch.full((self.slots, 1), self.pad, dtype=torch.long, device=self.device)
        positions = torch.zeros((self.slots, 1), dtype=torch.long, device=self.device)
        allow_end = torch.ones(self.slots, dtype=torch.bool, device=self.device)
        self.decoding.prefill(self.cache, tokens)  # the cache's buffers come with a first (eager) write
        windows = self.windows()
        for length in windows:
            for _ in range(2):
                self.decoding.step(self._reading(length), tokens, positions, self.banned, self.end_tokens, allow_end)
        self.cache.clear()
        logger.info("compiled the decoding step of %d slots for %d windows of positions (%s) in %.1f s", self.slots,
                    len(windows), ", ".join(map(str, windows)), time.perf_counter() - started)

    def refusal(self, job: Job) -> Optional[Tuple[str, str]]:
        if job.prompt_length >= self.positions:
            return "prompt", (f"a prompt of {job.prompt_length} tokens leaves no room for a new one in this server's "
                    f"{self.positions} positions per sequence (--max-model-len)")
        if job.rows > self.slots:
            return "prompt", (f"the request needs {job.rows} sequences (prompts x best_of); this server decodes at most "
                    f"{self.slots} at once (--max-batch-tokens {self.max_batch_tokens} / {self.positions} positions "
                    "each): send fewer prompts or a lower best_of")
        return None

    # -- the worker ---------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            if self.decoding.compiled:
                self._compile_windows()
        except BaseException as error:  # start() raises it: the server does not listen
            self.start_error = error
            return
        finally:
            self.ready.set()
        while True:
            with self.changed:
                self._drop_gone()
                while not self.waiting and not self.requests and not self.closed:
                    self.changed.wait()
                    self._drop_gone()
                if self.closed and not self.waiting and not self.requests:
                    return
                beam_job = self._admit()
            try:
                if beam_job is not None:
                    self._decode_alone(beam_job)
                else:
                    self._turn()
            except Exception as error:  # a fault of the server: its requests fail, the worker goes on
                logger.exception("decoding %d requests failed", len(self.requests) or 1)
                failed = [r.job for r in self.requests] + ([beam_job] if beam_job is not None else [])
                for job in failed:
                    job.deliver(Failed(f"the server failed to decode this request ({type(error).__name__}: {error})"))
                self.requests, self.free = [], list(range(self.slots))
                self.cache.clear()
            with self.changed:
                self.running = len(self.requests)
                self._gauges()

    def _admit(self) -> Optional[Job]:
        """Under `changed`: move waiting jobs into free slots, oldest first; returns a beam
        search job to decode alone once nothing else runs."""
        for request in [r for r in self.requests if r.job.cancelled or r.job.expired(time.monotonic())]:
            if not request.job.cancelled:
                request.job.deliver(request.job.timed_out())
            self._release(request)
        while self.waiting:
            job = self.waiting[0]
            if job.options.beams > 1:
                if self.requests:
                    return None  # drain first
                self.waiting.pop(0)
                return job
            if job.rows > len(self.free):
                return None
            self.waiting.pop(0)
            generator = SequenceGenerator([self.interface.model], self.interface.dictionary, job.options,
                                          decode=self.interface.tokenizer.decode)
            request = Request(job, generator, self.positions, self.device)
            for sequence in request.sequences:
                sequence.slot = self.free.pop(0)
            self.requests.append(request)
        return None

    def _release(self, request: Request) -> None:
        self.requests.remove(request)
        self.free.extend(s.slot for s in request.sequences if s.reason is None)
        self.free.sort()  # low slots first: the used ones stay together

    def _decode_alone(self, job: Job) -> None:
        self.running = 1
        self._gauges()
        results = self.interface.generate(job.prompts, options=job.options)
        job.deliver(Done(results))

    @torch.no_grad()
    def _turn(self) -> None:
        self._prefill()
        for request in list(self.requests):  # a request may end at its first token
            if request.step < 0 and all(s.prefilled for s in request.sequences):
                request.step = 0
                lprobs = torch.stack([s.next_lprobs for s in request.sequences])
                for s in request.sequences:
                    s.next_lprobs = None
                allow_end = torch.full((len(request.sequences),), request.min_tokens <= 0, device=self.device)
                _, allowed, greedy = static_decoding.choices(lprobs, self.banned, self.end_tokens, allow_end)
                self._choose([(request, request.sequences, list(range(len(request.sequences))))],
                             lprobs, allowed, greedy)
        decoding = [r for r in self.requests if r.step > 0]
        if decoding:
            self._step(decoding)

    def _prefill(self) -> None:
        """Up to `prefill_tokens` (padded) prompt tokens into their slots, oldest first, as one
        right-padded forward; the last chunk of a prompt leaves its next-token log-probs."""
        group: List[Sequence] = []
        width = 0
        for sequence in (s for r in self.requests for s in r.sequences if not s.prefilled):
            rest = len(sequence.prompt) - sequence.filled
            if not group:
                width = min(rest, self.prefill_tokens)
            elif (len(group) + 1) * max(width, rest) > self.prefill_tokens:
                break
            else:
                width = max(width, rest)
            group.append(sequence)
        if not group:
            return
        tokens = torch.full((len(group), width), self.pad, dtype=torch.long)
        positions = torch.empty((len(group), width), dtype=torch.long)
        for row, s in enumerate(group):
            chunk = s.prompt[s.filled:s.filled + width]
            tokens[row, :len(chunk)] = torch.tensor(chunk)
            # Pads go on past the chunk, where the sequence's own tokens overwrite them before
            # they are read; clamped to the cache (a pad at its last position: same rule).
            positions[row] = (s.filled + torch.arange(width)).clamp(max=self.cache.capacity - 1)
        slots = torch.tensor([s.slot for s in group], device=self.device)
        features, extra = self.decoder.extract_features(
            tokens.to(self.device), kv_cache=self.cache, positions=positions.to(self.device), slots=slots)
        # The features whose log-probs are needed: every chunk position of an echoed prompt (its
        # tokens' scores), else only a prompt's last one (the first new token's distribution).
        wanted = []
        for row, s in enumerate(group):
            length = min(width, len(s.prompt) - s.filled)
            first = 0 if s.request.job.options.echo else (length - 1 if s.filled + length == len(s.prompt) else length)
            wanted.append((row, first, length))
        picked = [features[row, first:length] for row, first, length in wanted if first < length]
        if picked:
            lprobs = self._log_probs(torch.cat(picked), extra)
        at = 0
        for (row, first, length), s in zip(wanted, group):
            chunk_lprobs = lprobs[at:at + length - first] if first < length else None
            at += length - first
            start = s.filled
            s.filled += length
            if s.request.job.options.echo:
                # Position p predicts prompt token p + 1 (the prompt's last position: a new token).
                scored = chunk_lprobs[:min(length, len(s.prompt) - 1 - start)]
                targets = torch.tensor(s.prompt[start + 1:start + 1 + scored.size(0)], device=self.device)
                s.prompt_scores.append(scored.gather(1, targets[:, None]).squeeze(1).cpu())
                if s.request.job.options.logprobs:
                    values, ids = scored.topk(s.request.job.options.logprobs, dim=-1)
                    s.prompt_tops.append((values.cpu(), ids.cpu()))
            if s.prefilled:
                s.next_lprobs = chunk_lprobs[-1]

    def _log_probs(self, features: torch.Tensor, extra) -> torch.Tensor:
        """(N, V) fp32 log-probs from (N, C) features."""
        logits = self.decoder.output_layer(features[None])
        return self.decoder.get_normalized_probs((logits, extra), log_probs=True)[0]

    def _step(self, decoding: List[Request]) -> None:
        """One token for every decoding sequence: a step over the slots (the others write a pad
        where their own tokens will overwrite it), then each request's choice. The step reads
        the cache up to the furthest position only: short sequences do not pay for the
        capacity. Compiled, it covers every slot and a power of two of positions (a graph per
        bucket, a few in all); eager, only the slots up to the last busy one (free slots are
        taken lowest first) and the positions exactly."""
        tokens = torch.full((self.slots, 1), self.pad, dtype=torch.long)
        positions = torch.zeros((self.slots, 1), dtype=torch.long)
        allow_end = torch.ones(self.slots, dtype=torch.bool)
        busy = [(request, s) for request in self.requests for s in request.sequences if s.reason is None]
        for request, s in busy:
            if request.step > 0:
                tokens[s.slot, 0] = s.new_tokens[-1]
                positions[s.slot, 0] = s.position
                allow_end[s.slot] = request.step >= request.min_tokens
            else:  # still prefilling (or waiting for its siblings): its next chunk overwrites this
                positions[s.slot, 0] = min(s.filled, self.cache.capacity - 1)
        rows = self.slots if self.decoding.compiled else 1 + max(s.slot for _, s in busy)
        furthest = 1 + int(positions[:rows].max())
        # Compiled, the positions read come in a few buckets (a graph each); eager, exactly.
        length = self.decoding.buckets(1, furthest)[1] if self.decoding.compiled else furthest
        lprobs, allowed, greedy = self.decoding.step(
            self._reading(length), tokens[:rows].to(self.device), positions[:rows].to(self.device), self.banned,
            self.end_tokens, allow_end[:rows].to(self.device))
        self._choose([(request, request.going, [s.slot for s in request.going]) for request in decoding],
                     lprobs, allowed, greedy)

    def _reading(self, length: int):
        """The cache as a step that reads its first `length` positions sees it."""
        return self.cache.window(length) if length < self.cache.capacity else self.cache

    def _choose(self, entries, lprobs: torch.Tensor, allowed: torch.Tensor, greedy: torch.Tensor) -> None:
        """The next token of each going sequence: `entries` are (request, its going sequences,
        their rows of `lprobs`/`allowed`/`greedy`). Greedy takes `greedy`; a request that samples
        draws from its own generator over its rows, and one with stop tokens before its
        min_tokens bans them too (the step bans only eos). Then each token is kept, streamed and
        checked for the end, with one read of the device for all."""
        chosen = greedy
        for request, going, rows in entries:
            extra_bans = request.extra_ends is not None and request.step < request.min_tokens
            if request.rng is None and not extra_bans:
                continue
            index = torch.tensor(rows, device=self.device)
            own_allowed, own_greedy = allowed.index_select(0, index), greedy.index_select(0, index)
            if extra_bans:
                _, own_allowed, own_greedy = static_decoding.choices(
                    lprobs.index_select(0, index), self.banned, request.extra_ends,
                    torch.zeros(len(rows), dtype=torch.bool, device=self.device))
            own = own_greedy if request.rng is None else request.generator.draw(own_allowed, request.rng)
            chosen = chosen.index_copy(0, index, own)
        scores = lprobs.gather(1, chosen[:, None]).squeeze(1)
        values = torch.stack([chosen.to(scores.dtype), scores]).cpu().tolist()
        for request, going, rows in entries:
            k = request.job.options.logprobs
            if k:
                top_values, top_ids = lprobs.index_select(0, torch.tensor(rows, device=self.device)).topk(k, dim=-1)
                top_values, top_ids = top_values.cpu(), top_ids.cpu()
            for i, (s, row) in enumerate(zip(going, rows)):
                token = int(values[0][row])
                s.new_tokens.append(token)
                s.scores.append(values[1][row])
                if k:
                    s.tops.append((top_values[i], top_ids[i]))
                request.job.deliver(Token(s.prompt_index, token))
                s.reason = request.generator.finish_reason(s.new_tokens, request.step, request.min_tokens,
                                                             request.max_tokens)
                if s.reason is not None:
                    self.free.append(s.slot)
            request.step += 1
            if not request.going:
                self._finish(request)
        self.free.sort()

    def _finish(self, request: Request) -> None:
        generator, options = request.generator, request.job.options
        per_prompt: List[List[List[dict]]] = [[] for _ in request.job.prompts]
        for s in request.sequences:
            hypo = generator.hypothesis(s.new_tokens, s.scores, s.tops, s.reason)
            if options.echo:
                hypo["prompt_tokens"] = torch.tensor(s.prompt, dtype=torch.long)
                hypo["prompt_scores"] = torch.cat([torch.tensor([float("nan")]), *s.prompt_scores])
                if options.logprobs:
                    hypo["prompt_top_logprobs"] = torch.cat([values for values, _ in s.prompt_tops])
                    hypo["prompt_top_tokens"] = torch.cat([ids for _, ids in s.prompt_tops])
            per_prompt[s.prompt_index].append([hypo])
        results = [[self.interface.result(h, options, isinstance(prompt, TextIds)) for h in generator.best(hypos)]
                   for prompt, hypos in zip(request.job.prompts, per_prompt)]
        self.requests.remove(request)
        request.job.deliver(Done(results))
