"""`StaticDecoding`: one model's decoding on a `StaticKVCache`: the prompts' prefill, then a
one-token step whose shapes never change, compiled once per (batch, capacity) bucket.

    decoding = StaticDecoding.of(model.decoder)            # one per model, kept with it
    cache = decoding.cache(rows=3, positions=160)          # slots and capacity rounded up to buckets
    features, extra = decoding.prefill(cache, tokens)      # (B, T) right-padded prompts, eager
    lprobs, allowed, greedy = decoding.step(cache, next_tokens, positions, banned, end_tokens, allow_end)

The step (every layer, the output projection, the log-softmax, the bans and the greedy choice)
is `torch.compile`d: inductor on the CPU, and on CUDA with `mode="reduce-overhead"`, which
replays it as a CUDA graph (one launch per token instead of hundreds: a batch-1 step is bound by
launches, not by the GPU). Everything that changes from step to step is a tensor (tokens,
positions, which rows may end), so a bucket compiles once; the cache's buffers are module
buffers, which CUDA graphs keep at fixed addresses. Where compiling fails the step runs eagerly,
after one warning; `compile=False` (`mseq generate --no-compile`) never compiles.

Decoders opt in by taking `kv_cache=` in `extract_features` (`TransformerDecoder` does);
`supports(decoder)` says whether one does. Others decode through `incremental_state`.
"""

import inspect
import warnings
from collections import OrderedDict
from typing import Callable, Optional, Tuple

import torch

from metaseq_ds.modules.kv_cache import StaticKVCache

# Caches kept for reuse (each is as large as its bucket): a server that sees many shapes would
# otherwise keep one per bucket it ever used. A bucket that comes back after its cache went
# allocates a new one (and, on CUDA, records its CUDA graph again).
KEPT_CACHES = 4
SMALLEST_CAPACITY = 64  # positions; capacities are powers of two from here, so few buckets compile
NEG_INF = float("-inf")


def supports(decoder) -> bool:
    """Whether `decoder` can run on a `StaticKVCache` (its extract_features takes `kv_cache`)."""
    return "kv_cache" in inspect.signature(decoder.extract_features).parameters


def should_compile(requested: Optional[bool], device: torch.device) -> bool:
    """`requested`, or by default: on CUDA, where a small batch's step is bound by kernel
    launches, which a CUDA graph removes. Not on the CPU: there inductor's step is faster at
    batch 1 (1.3x in benchmarks/generate.py) but takes 5-20 s to compile per batch bucket, which
    a few prompts never win back; `--compile` pays it for long runs."""
    return requested if requested is not None else torch.device(device).type == "cuda"


def power_of_two_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def decode_step(decoder, cache: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor,
                banned: torch.Tensor, end_tokens: torch.Tensor, allow_end: torch.Tensor):
    """One token per slot: (B, 1) tokens at (B, 1) positions -> (B, V) fp32 log-probs, the same
    with the `banned` token ids and, in rows where `allow_end` (B,) is False, the `end_tokens`
    ids at -inf, and the greedy choice (B,) among what is allowed."""
    features, extra = decoder.extract_features(tokens, kv_cache=cache, positions=positions)
    logits = decoder.output_layer(features)  # (B, 1, V)
    lprobs = decoder.get_normalized_probs((logits, extra), log_probs=True)[:, -1]  # (B, V)
    return choices(lprobs, banned, end_tokens, allow_end)


def choices(lprobs: torch.Tensor, banned: torch.Tensor, end_tokens: torch.Tensor, allow_end: torch.Tensor):
    """(lprobs, allowed, greedy choice) of `decode_step`, from (B, V) log-probs; `banned` and
    `end_tokens` are token ids. Written with index ops on those few columns: masks over the
    whole (B, V) would cost as much as the log-softmax again."""
    allowed = lprobs.index_fill(1, banned, NEG_INF)
    ends = allowed.index_select(1, end_tokens).masked_fill(~allow_end[:, None], NEG_INF)  # (B, E)
    allowed.index_copy_(1, end_tokens, ends)
    return lprobs, allowed, allowed.argmax(dim=-1)


class StaticDecoding:
    """Prefill and compiled step of one decoder, and the caches they use (kept for reuse: a
    compiled step is tied to its cache's buffers)."""

    def __init__(self, decoder, compile: bool = True):
        if not supports(decoder):
            raise TypeError(f"{type(decoder).__name__}.extract_features takes no kv_cache: it cannot use a StaticKVCache")
        self.decoder = decoder
        self.compiled = compile
        self._caches: "OrderedDict[Tuple, StaticKVCache]" = OrderedDict()
        self._step: Callable = self._compile(decode_step) if compile else decode_step

    @classmethod
    def of(cls, decoder, compile: bool = True) -> "StaticDecoding":
        """The decoding of `decoder`, made once per decoder and setting: compiled steps are reused
        by every generation with it (the step compiles at its first use in each bucket)."""
        made = decoder.__dict__.setdefault("_static_decodings", {})
        if compile not in made:
            made[compile] = cls(decoder, compile)
        return made[compile]

    def _compile(self, step: Callable) -> Callable:
        device = next(self.decoder.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" else None
        return torch.compile(step, mode=mode, dynamic=False)

    def buckets(self, rows: int, positions: int) -> Tuple[int, int]:
        """(slots, capacity) for `rows` sequences of up to `positions` tokens: exact when not
        compiling, else powers of two (capacity at least SMALLEST_CAPACITY, at most the model's
        positions), so that few shapes compile."""
        if not self.compiled:
            return rows, positions
        limit = self.decoder.max_positions()
        return power_of_two_at_least(rows), min(max(power_of_two_at_least(positions), SMALLEST_CAPACITY), limit)

    def cache(self, rows: int, positions: int) -> StaticKVCache:
        """A cleared cache of at least `rows` slots of at least `positions` positions (see `buckets`)."""
        parameter = next(self.decoder.parameters())
        slots, capacity = self.buckets(rows, positions)
        key = (slots, capacity, parameter.device, parameter.dtype)
        if key not in self._caches:
            if len(self._caches) == KEPT_CACHES:
                self._caches.popitem(last=False)  # the least recently used bucket's memory goes
            self._caches[key] = StaticKVCache(slots, capacity)
        self._caches.move_to_end(key)
        cache = self._caches[key]
        cache.clear()
        return cache

    def prefill(self, cache: StaticKVCache, tokens: torch.Tensor, slots: Optional[torch.Tensor] = None):
        """Run right-padded prompts (B, T) into `slots` (None: 0 .. B-1) from position 0, eagerly;
        returns their (B, T, C) features and side outputs. Pads after a prompt write keys that
        the mask hides until the slot's own tokens overwrite them."""
        positions = torch.arange(tokens.size(1), device=tokens.device).expand(tokens.size(0), -1)
        return self.decoder.extract_features(tokens, kv_cache=cache, positions=positions, slots=slots)

    def step(self, cache: StaticKVCache, tokens: torch.Tensor, positions: torch.Tensor, banned: torch.Tensor,
             end_tokens: torch.Tensor, allow_end: torch.Tensor):
        """`decode_step` over every slot of `cache`, compiled. The results are valid until the
        next step (on CUDA they live in the CUDA graph's memory): copy what must last."""
        if self._step is not decode_step and tokens.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        try:
            return self._step(self.decoder, cache, tokens, positions, banned, end_tokens, allow_end)
        except Exception as error:  # noqa: BLE001 - any compiler failure: decode eagerly instead
            if self._step is decode_step:
                raise
            first_line = (str(error).splitlines() or [""])[0]
            warnings.warn(f"compiling the decoding step failed ({type(error).__name__}: {first_line}); "
                          "decoding without compiling", RuntimeWarning, stacklevel=2)
            self._step = decode_step
            return decode_step(self.decoder, cache, tokens, positions, banned, end_tokens, allow_end)
