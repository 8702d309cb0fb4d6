"""`SequenceGenerator`: greedy decoding, sampling (temperature, top-k, top-p) and beam search
over any decoder that follows the incremental decoding API of `metaseq_ds.models.base`.

    options = GenerationOptions(max_tokens=32, temperature=0.7, top_p=0.9, seed=1)
    generator = SequenceGenerator([model], task.dictionary, options)
    # or metaseq's keywords: SequenceGenerator([model], task.dictionary, max_new_tokens=32, temperature=0.7, topp=0.9)
    # or metaseq's generation flags (task.build_generator): options_from_generation_config(args)
    hypos = generator.generate([model], [[2, 713, 16], [2, 9]])  # prompts: token ids, any lengths
    hypos[i][0]["tokens"], hypos[i][0]["positional_scores"], hypos[i][0]["finish_reason"]

Prompts are left-padded into one batch (positions count real tokens only, so every row is
embedded as if alone). The first call runs the prompts and fills the KV cache; each later
step runs one token per row. Rows that finish leave the batch (`reorder_incremental_state`),
and beam search reorders the cache to follow the surviving beams.

Each hypothesis is a dict:
- `tokens`: the new token ids (LongTensor), ending with eos or the stop tokens when those ended it;
- `positional_scores`: the model's log-probability of each new token (log-softmax of its
  logits, before temperature, top-k or top-p);
- `score`: sum(positional_scores) / len ** length_penalty (the `n` returned are the best by it);
- `finish_reason`: "eos" (the model emitted </s>), "stop" (a stop token sequence or stop
  string completed), "length" (max_tokens, or the model's max positions, was reached);
- with `logprobs` k > 0: `top_logprobs` / `top_tokens`, (len, k) the k most likely tokens at each step;
- with `echo`: `prompt_scores` (the first prompt token has none: NaN) and, with `logprobs`,
  `prompt_top_logprobs` / `prompt_top_tokens`.

Beam search (`best_of` > 1, temperature 0) is Hugging Face's: 2 * beams candidates per
step, finished beams scored with the length penalty over the generated length, the same
early-stopping heuristic, so both give the same tokens. Stop strings do not steer beam
search: `GeneratorInterface` cuts the finished beams' text at them afterwards.
"""

import dataclasses
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from metaseq_ds import static_decoding
from metaseq_ds.dataclass import validate_config
from metaseq_ds.dataclass.configs import GenerationConfig
from metaseq_ds.dataclass.utils import flag
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions, StopItem
from metaseq_ds.incremental_decoding_utils import reserve_positions

EOS, STOP, LENGTH = "eos", "stop", "length"
# Steps between the static path's reads of the new tokens (greedy, not streaming): a read waits
# for the device, so rarer reads let it run ahead; at most SYNC_EVERY - 1 steps are wasted when
# every row has already finished.
SYNC_EVERY = 8
NEG_INF = float("-inf")
NOT_A_BEAM = -1.0e9  # Hugging Face's score for beams that must not be chosen (keeps ranks identical)

Hypothesis = Dict[str, object]
StreamCallback = Callable[[int, int], None]


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """`logits` with all but the k largest of each row set to -inf; k <= 0 keeps every token."""
    if k <= 0 or k >= logits.size(-1):
        return logits
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, NEG_INF)


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """`logits` with -inf outside the nucleus: the most probable tokens whose mass first reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # the most probable token always has 0 < p
    remove_sorted = mass_before >= p
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def left_pad(prompts: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """(B, T) LongTensor, each prompt right-aligned after `pad`s."""
    return _padded(prompts, pad, pads_first=True)


def right_pad(prompts: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """(B, T) LongTensor, each prompt left-aligned before `pad`s."""
    return _padded(prompts, pad, pads_first=False)


def _padded(prompts: Sequence[Sequence[int]], pad: int, pads_first: bool) -> torch.Tensor:
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        start = width - len(prompt) if pads_first else 0
        tokens[row, start:start + len(prompt)] = torch.as_tensor(list(prompt), dtype=torch.long)
    return tokens


def add_prompt_info(hypos: List[List[Hypothesis]], prompt_info: Optional[List[Dict[str, torch.Tensor]]]) -> None:
    """Give each row's hypotheses its prompt's scores (echo)."""
    if prompt_info is not None:
        for row_hypos, info in zip(hypos, prompt_info):
            for hypo in row_hypos:
                hypo.update(info)


class StopCriteria:
    """Stop token sequences and stop strings, checked on a row's new tokens after each step.

    A stop string is found in the decoded tail of the new tokens (long enough to hold the
    longest string, since every non-special token decodes to at least one byte), so the
    check costs the same at step 10 and at step 1000.
    """

    def __init__(self, stop: Sequence[StopItem], decode: Optional[Callable[[List[int]], str]]):
        self.strings = [s for s in stop if isinstance(s, str)]
        self.sequences = [[s] if isinstance(s, int) else list(s) for s in stop if not isinstance(s, str)]
        if self.strings and decode is None:
            raise ValueError("stop strings need a decode function (token ids -> text)")
        self.decode = decode
        self.window = max((len(s.encode("utf-8")) for s in self.strings), default=0) + 1
        self.single_tokens = sorted({s[0] for s in self.sequences if len(s) == 1})

    def __bool__(self) -> bool:
        return bool(self.sequences or self.strings)

    def hit(self, new_tokens: List[int]) -> bool:
        for sequence in self.sequences:
            if new_tokens[-len(sequence):] == sequence:
                return True
        if self.strings:
            tail = self.decode(new_tokens[-self.window:])
            return any(s in tail for s in self.strings)
        return False


# metaseq's keyword names for the GenerationOptions fields, so that errors name what was passed.
METASEQ_KEYWORDS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "top_p": "topp", "top_k": "topk",
                    "n": "beam_size", "best_of": "beam_size", "logprobs": "logprobs_topk"}


def options_from_keywords(
    beam_size: Optional[int] = None,
    max_new_tokens: Optional[int] = None,
    min_new_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    topp: Optional[float] = None,
    topk: Optional[int] = None,
    length_penalty: Optional[float] = None,
    stop: Sequence[Union[int, Sequence[int]]] = (),
    stop_strings: Sequence[str] = (),
    need_logprobs: bool = False,
    logprobs_topk: int = 1,
    echo: Optional[bool] = None,
    seed: Optional[int] = None,
) -> GenerationOptions:
    """`GenerationOptions` from metaseq's SequenceGenerator keywords (None: the option's default).

    `beam_size` beams return `beam_size` hypotheses (n = best_of); `topp` -1 is metaseq's "off";
    `need_logprobs` with `logprobs_topk` is `logprobs`.
    """
    given = {"n": beam_size, "best_of": beam_size, "max_tokens": max_new_tokens, "min_tokens": min_new_tokens,
             "temperature": temperature, "top_p": None if topp == -1 else topp, "top_k": topk,
             "length_penalty": length_penalty, "stop": (*stop, *stop_strings),
             "logprobs": max(1, logprobs_topk) if need_logprobs else 0, "echo": echo, "seed": seed}
    options = GenerationOptions.from_values({k: v for k, v in given.items() if v is not None},
                                            name=lambda field: METASEQ_KEYWORDS.get(field, field))
    if options.beams < options.best_of:  # beams at temperature > 0 would become best_of samples
        raise UsageError("beam search is deterministic: use temperature 0 with a beam size > 1")
    return options


# The GenerationOptions field each of metaseq's generation flags sets, to name them in errors.
METASEQ_GENERATION_FLAGS = {"n": "--beam", "best_of": "--beam", "max_tokens": "--max-len-b", "min_tokens": "--min-len",
                            "temperature": "--temperature", "top_p": "--sampling-topp", "top_k": "--sampling-topk",
                            "length_penalty": "--lenpen"}


def options_from_generation_config(args: Any) -> GenerationOptions:
    """`GenerationOptions` from metaseq's generation flags: `args` is a `GenerationConfig`, or any
    object (an argparse namespace, a metaseq `cfg.generation`) whose attributes named as its fields
    are read, the others taking GenerationConfig's defaults.

    As in metaseq, `--beam` completions are returned and the temperature decides: above 0 they
    are independent samples, at 0 the beams of a beam search (metaseq's were copies of one greedy
    completion); `--sampling-topp` needs `--sampling`. Lengths count new tokens only.
    """
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig) if hasattr(args, f.name)}
    cfg = validate_config(GenerationConfig, given, flag_of=flag)
    if not cfg.sampling and (cfg.sampling_topp > 0 or cfg.sampling_topk > 0):
        raise UsageError("--sampling-topp and --sampling-topk require --sampling")
    return GenerationOptions.from_values({
        "n": cfg.beam, "best_of": cfg.beam, "max_tokens": cfg.max_len_b, "min_tokens": cfg.min_len,
        "temperature": cfg.temperature, "top_p": cfg.sampling_topp if cfg.sampling_topp > 0 else 1.0,
        "top_k": max(cfg.sampling_topk, 0), "length_penalty": cfg.lenpen,
    }, name=lambda field: METASEQ_GENERATION_FLAGS.get(field, field))


class Limits(NamedTuple):
    """New tokens per row: at least `min[row]` (no eos or stop before), at most `max[row]`."""

    min: List[int]
    max: List[int]


def _per_prompt(values: Optional[Sequence[int]], default: int, count: int, name: str) -> List[int]:
    if values is None:
        return [default] * count
    if len(values) != count:
        raise UsageError(f"{name}: {len(values)} values for {count} prompts")
    return list(values)


class SequenceGenerator(nn.Module):
    """Generates continuations of token prompts with one model (metaseq's class name and
    `generate(models, sample)` entry point; lengths count new tokens only).

    It decodes as one `GenerationOptions` says: temperature 0 greedily (or by beam search over
    `best_of` beams); temperature > 0 by sampling `best_of` completions per prompt from
    softmax(logits / temperature) restricted by `top_k` (0: off) and `top_p`; either way it
    returns the best `n`. `seed` makes sampling reproducible. metaseq's keywords (`beam_size`,
    `max_new_tokens`, `topp`, ...: see `options_from_keywords`) build the options instead;
    `decode` (token ids -> text) is needed for stop strings.
    """

    def __init__(self, models: Sequence[nn.Module], tgt_dict, options: Optional[GenerationOptions] = None, *,
                 decode: Optional[Callable[[List[int]], str]] = None, compile: Optional[bool] = None,
                 static_cache: bool = True, **metaseq_keywords):
        super().__init__()
        if options is None:
            options = options_from_keywords(**metaseq_keywords)
        elif metaseq_keywords:
            raise TypeError(f"give SequenceGenerator options= or metaseq's keywords, not both: {sorted(metaseq_keywords)}")
        if len(models) != 1:
            raise UsageError(f"SequenceGenerator takes one model; got {len(models)} (ensembles are not supported)")
        self.options = options
        self.model = models[0]
        self.decoder = self.model.decoder if hasattr(self.model, "decoder") else self.model
        self.pad, self.eos = tgt_dict.pad(), tgt_dict.eos()
        self.stop = StopCriteria(options.stop, decode)
        self.compile = compile
        self.static_cache = static_cache

    @torch.no_grad()
    def generate(self, models, sample, stream: Optional[StreamCallback] = None, *,
                 min_tokens: Optional[Sequence[int]] = None,
                 max_tokens: Optional[Sequence[int]] = None) -> List[List[Hypothesis]]:
        """Hypotheses per prompt: the best `n` (of `best_of` beams or samples), best first.

        `sample`: a list of token-id prompts, or metaseq's `{"net_input": {"src_tokens": (B, T)}}`
        (pads anywhere are dropped). `stream(prompt_index, token_id)` is called for each new
        token as it is chosen (not with beam search, whose beams change until the end).
        `min_tokens` / `max_tokens`: one limit per prompt instead of the options' (prompts of
        different requests decode in one batch, each to its own length).
        """
        if isinstance(sample, dict):
            src = sample["net_input"]["src_tokens"]
            prompts = [[t for t in row.tolist() if t != self.pad] for row in src]
        else:
            prompts = [list(p) for p in sample]
        if not prompts or any(not p for p in prompts):
            raise UsageError("every prompt needs at least one token")
        self.model.eval()
        device = next(self.model.parameters()).device
        copies = self.options.samples
        rows = [prompt for prompt in prompts for _ in range(copies)]  # each prompt once per sample
        tokens = left_pad(rows, self.pad).to(device)
        room = self.decoder.max_positions() - tokens.size(1)
        if room < 1:
            raise UsageError(f"a prompt of {tokens.size(1)} tokens leaves no room in the model's {self.decoder.max_positions()} positions")
        mins = _per_prompt(min_tokens, self.options.min_tokens, len(prompts), "min_tokens")
        maxs = [min(limit, room) for limit in _per_prompt(max_tokens, self.options.max_tokens, len(prompts), "max_tokens")]
        # Each row's limits (a prompt's samples are `copies` consecutive rows).
        limits = Limits([m for m in mins for _ in range(copies)], [m for m in maxs for _ in range(copies)])
        if self.options.beams == 1 and self.static_cache and static_decoding.supports(self.decoder):
            hypos = self._decode_static(rows, limits, device, stream)
            return [self.best(hypos[i * copies:(i + 1) * copies]) for i in range(len(prompts))]
        state: Dict = {}
        reserve_positions(state, tokens.size(1) + max(maxs))  # the KV cache is allocated once
        features, extra = self.decoder.extract_features(tokens, incremental_state=state)
        prompt_info = self._score_prompts(features, extra, tokens, rows, right_padded=False) if self.options.echo else None
        logits = self._next_log_probs(features, extra)
        if self.options.beams > 1:
            hypos = self._beam_search(tokens, state, logits, limits)  # the finished beams of each row
        else:
            hypos = self._sample(tokens, state, logits, limits, device, stream)  # one per row
        add_prompt_info(hypos, prompt_info)
        return [self.best(hypos[i * copies:(i + 1) * copies]) for i in range(len(prompts))]

    def best(self, rows_hypos: List[List[Hypothesis]]) -> List[Hypothesis]:
        candidates = sorted((h for row_hypos in rows_hypos for h in row_hypos), key=lambda h: -h["score"])
        return candidates[:self.options.n]

    forward = generate

    # -- one model step -----------------------------------------------------------------------

    def _next_log_probs(self, features: torch.Tensor, extra) -> torch.Tensor:
        """(A, V) fp32 log-probs of the next token of each row, from the last position's features."""
        logits = self.decoder.output_layer(features[:, -1:])
        return self.decoder.get_normalized_probs((logits, extra), log_probs=True)[:, -1]

    def _step(self, tokens: torch.Tensor, state: Dict) -> torch.Tensor:
        features, extra = self.decoder.extract_features(tokens, incremental_state=state)
        return self._next_log_probs(features, extra)

    def _ban(self, lprobs: torch.Tensor, step: int, mins: Sequence[int]) -> torch.Tensor:
        """No pad ever (it would be read as padding); no eos or stop token in a row before its
        min_tokens (`mins`: one per row of `lprobs`)."""
        allowed = lprobs.index_fill(1, torch.tensor([self.pad], device=lprobs.device), NEG_INF)
        early = [row for row, least in enumerate(mins) if step < least]
        if early:
            ends = torch.tensor([self.eos, *self.stop.single_tokens], device=lprobs.device)
            allowed[torch.tensor(early, device=lprobs.device)[:, None], ends] = NEG_INF
        return allowed

    def finish_reason(self, new_tokens: List[int], step: int, min_new: int, max_new: int) -> Optional[str]:
        if new_tokens[-1] == self.eos:
            return EOS
        if step >= min_new and self.stop and self.stop.hit(new_tokens):
            return STOP
        if step + 1 >= max_new:
            return LENGTH
        return None

    def _top(self, lprobs: torch.Tensor):
        return lprobs.topk(self.options.logprobs, dim=-1)

    # -- greedy and sampling ------------------------------------------------------------------

    def _sample(self, tokens, state, lprobs, limits: Limits, device, stream) -> List[List[Hypothesis]]:
        batch = tokens.size(0)
        rows = list(range(batch))  # the batch index of each row still decoding
        new_tokens: List[List[int]] = [[] for _ in range(batch)]
        scores: List[List[float]] = [[] for _ in range(batch)]
        tops: List[list] = [[] for _ in range(batch)]
        reasons: List[Optional[str]] = [None] * batch
        rng = self.sampling_generator(device) if self.options.temperature > 0 else None  # greedy draws nothing
        for step in range(max(limits.max)):
            allowed = self._ban(lprobs, step, [limits.min[row] for row in rows])
            if self.options.temperature == 0:
                chosen = allowed.argmax(dim=-1)  # (A,)
            else:
                chosen = self.draw(allowed, rng)
            chosen_scores = lprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
            if self.options.logprobs:
                top_values, top_ids = self._top(lprobs)
            keep = []
            for i, (row, token) in enumerate(zip(rows, chosen.tolist())):
                new_tokens[row].append(token)
                scores[row].append(chosen_scores[i])
                if self.options.logprobs:
                    tops[row].append((top_values[i], top_ids[i]))
                if stream is not None:
                    stream(row // self.options.samples, token)  # the prompt whose sample this is
                reasons[row] = self.finish_reason(new_tokens[row], step, limits.min[row], limits.max[row])
                if reasons[row] is None:
                    keep.append(i)
            if not keep:
                break
            tokens = torch.cat([tokens, chosen[:, None]], dim=1)  # (A, S + 1)
            if len(keep) < len(rows):
                order = torch.tensor(keep, device=device)
                tokens = tokens.index_select(0, order)
                self.decoder.reorder_incremental_state(state, order)
                rows = [rows[i] for i in keep]
            lprobs = self._step(tokens, state)
        return [[self.hypothesis(new_tokens[r], scores[r], tops[r], reasons[r])] for r in range(batch)]

    def _decode_static(self, rows: List[List[int]], limits: Limits, device, stream) -> List[List[Hypothesis]]:
        """Greedy decoding or sampling on a `StaticKVCache`: the prompts prefilled (right-padded,
        eagerly), then the compiled step for every slot at once until every row has finished.

        Rows that finish go on decoding (their tokens are dropped) so that the step keeps its
        shape; slots beyond the rows (a bucket's rounding) decode a copy of row 0. The device is
        waited for only every SYNC_EVERY steps, to read the new tokens and see which rows have
        finished (each step when sampling, which draws for the rows still going, as the
        incremental path does, or when streaming).
        """
        decoding = static_decoding.StaticDecoding.of(self.decoder, compile=static_decoding.should_compile(self.compile, device))
        count, longest = len(rows), max(len(row) for row in rows)
        max_new = max(limits.max)
        cache = decoding.cache(count, longest + max_new)
        slots = cache.slots
        filled = rows + [rows[0]] * (slots - count)
        tokens = right_pad(filled, self.pad).to(device)  # (S, W)
        lengths = torch.tensor([len(row) for row in filled], device=device)
        features, extra = decoding.prefill(cache, tokens)
        prompt_info = self._score_prompts(features[:count], extra, tokens[:count], rows, right_padded=True) \
            if self.options.echo else None
        last = features[torch.arange(slots, device=device), lengths - 1]  # (S, C)
        lprobs = self._next_log_probs(last[:, None], extra)  # (S, V)

        banned = torch.tensor([self.pad], device=device)
        end_tokens = torch.tensor([self.eos, *self.stop.single_tokens], device=device)
        least = torch.tensor(limits.min + [0] * (slots - count), device=device)

        out_tokens = torch.full((slots, max_new), self.pad, dtype=torch.long, device=device)
        out_scores = torch.zeros(slots, max_new, device=device)
        k = self.options.logprobs
        out_top_values = torch.zeros(slots, max_new, k, device=device) if k else None
        out_top_ids = torch.zeros(slots, max_new, k, dtype=torch.long, device=device) if k else None
        next_tokens = torch.empty(slots, 1, dtype=torch.long, device=device)
        positions = lengths[:, None].clone()  # where the next input token goes: (S, 1)

        sampling = self.options.temperature > 0
        rng = self.sampling_generator(device) if sampling else None
        sync_every = 1 if sampling or stream is not None else SYNC_EVERY
        new_tokens: List[List[int]] = [[] for _ in range(count)]
        reasons: List[Optional[str]] = [None] * count
        checked = 0
        lprobs, allowed, greedy = static_decoding.choices(lprobs, banned, end_tokens, least <= 0)
        for step in range(max_new):
            if step > 0:
                lprobs, allowed, greedy = decoding.step(cache, next_tokens, positions, banned, end_tokens, least <= step)
                positions += 1
            chosen = greedy
            if sampling:
                going = torch.tensor([row for row in range(count) if reasons[row] is None], device=device)
                chosen = greedy.index_copy(0, going, self.draw(allowed.index_select(0, going), rng))
            out_tokens[:, step] = chosen
            out_scores[:, step] = lprobs.gather(1, chosen[:, None]).squeeze(1)
            if k:
                out_top_values[:, step], out_top_ids[:, step] = self._top(lprobs)
            next_tokens.copy_(chosen[:, None])
            if (step + 1) % sync_every == 0 or step + 1 == max_new:
                for offset, row_tokens in enumerate(out_tokens[:count, checked:step + 1].T.tolist()):
                    self._take(row_tokens, checked + offset, new_tokens, reasons, limits, stream)
                checked = step + 1
                if all(reasons):
                    break
        scores = out_scores.cpu()
        tops = (out_top_values.cpu(), out_top_ids.cpu()) if k else None
        hypos = [[self.hypothesis(new_tokens[row], scores[row, :len(new_tokens[row])].tolist(),
                                   [(tops[0][row, j], tops[1][row, j]) for j in range(len(new_tokens[row]))] if k else [],
                                   reasons[row])]
                 for row in range(count)]
        add_prompt_info(hypos, prompt_info)
        return hypos

    def _take(self, step_tokens: List[int], step: int, new_tokens, reasons, limits: Limits, stream) -> None:
        """The tokens chosen at `step`, one per row: kept, streamed and checked for the end by
        the rows still going (the others decode on only to keep the step's shape)."""
        for row, token in enumerate(step_tokens):
            if reasons[row] is not None:
                continue
            new_tokens[row].append(token)
            if stream is not None:
                stream(row // self.options.samples, token)  # the prompt whose sample this is
            reasons[row] = self.finish_reason(new_tokens[row], step, limits.min[row], limits.max[row])

    def draw(self, allowed: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        """One token per row of `allowed` (A, V) log-probs, drawn as `options` say."""
        # log-probs differ from the logits by a constant per row: same softmax. Each row is
        # shifted to a maximum of 0 and scaled by a finite 1 / temperature, so that a tiny
        # temperature leaves its best token at 0 and sends the others to -inf (greedy), not
        # every token to -inf (a NaN softmax).
        shifted = allowed - allowed.max(dim=-1, keepdim=True).values
        scaled = shifted * min(1 / self.options.temperature, torch.finfo(shifted.dtype).max)
        masked = top_p_mask(top_k_mask(scaled, self.options.top_k), self.options.top_p)
        return torch.multinomial(masked.softmax(dim=-1), 1, generator=rng).squeeze(1)

    def sampling_generator(self, device) -> torch.Generator:
        """The generator of one call's draws, on the model's device: seeded by the options, or, with
        no seed, from torch's global generator, so that torch.manual_seed still decides."""
        seed = self.options.seed
        return torch.Generator(device=device).manual_seed(
            seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))

    def hypothesis(self, new_tokens, scores, tops, reason, score=None) -> Hypothesis:
        positional = torch.tensor(scores, dtype=torch.float)
        if score is None:
            score = positional.sum().item() / (len(scores) ** self.options.length_penalty)
        hypo = {"tokens": torch.tensor(new_tokens, dtype=torch.long), "positional_scores": positional,
                "score": score, "finish_reason": reason}
        if self.options.logprobs:
            hypo["top_logprobs"] = torch.stack([v for v, _ in tops]).cpu()
            hypo["top_tokens"] = torch.stack([i for _, i in tops]).cpu()
        return hypo

    # -- beam search --------------------------------------------------------------------------

    def _beam_search(self, tokens, state, lprobs, limits: Limits) -> List[List[Hypothesis]]:
        batch, n, device = tokens.size(0), self.options.beams, tokens.device
        expand = torch.arange(batch, device=device).repeat_interleave(n)  # every prompt n times
        tokens, lprobs = tokens.index_select(0, expand), lprobs.index_select(0, expand)
        self.decoder.reorder_incremental_state(state, expand)
        vocab = lprobs.size(-1)
        # Only the first copy of each prompt may expand at step 0, or the beams would be n copies.
        running = torch.zeros(batch, n, device=device)
        running[:, 1:] = NOT_A_BEAM
        active = list(range(batch))  # the prompt index of each group of n rows still searching
        finished: List[List[Hypothesis]] = [[] for _ in range(batch)]
        history = {"tokens": [[] for _ in range(batch * n)], "scores": [[] for _ in range(batch * n)],
                   "tops": [[] for _ in range(batch * n)]}
        for step in range(max(limits.max)):
            groups = len(active)
            allowed = self._ban(lprobs, step, [limits.min[prompt] for prompt in active for _ in range(n)])
            if self.options.logprobs:
                top_values, top_ids = self._top(lprobs)
            candidates = (allowed.view(groups, n, vocab) + running[:, :, None]).view(groups, n * vocab)
            cand_scores, cand_index = candidates.topk(2 * n, dim=-1)  # (G, 2n), best first
            cand_rows = torch.arange(groups, device=device)[:, None] * n + cand_index // vocab
            cand_tokens = cand_index % vocab
            last_step = [step + 1 >= limits.max[prompt] for prompt in active]  # per group
            ends = cand_tokens.eq(self.eos)
            for token in self.stop.single_tokens:
                ends |= cand_tokens.eq(token)
            ends[torch.tensor(last_step, device=device)] = True
            cand_logprob = allowed[cand_rows, cand_tokens]

            def extended(row: int, token: int, logprob: float):
                entry = {k: list(v[row]) for k, v in history.items()}
                entry["tokens"].append(token)
                entry["scores"].append(logprob)
                if self.options.logprobs:
                    entry["tops"].append((top_values[row], top_ids[row]))
                return entry

            # Only the n best candidates may finish (the other n are there so n beams can go on).
            gen_len = step + 1
            for g, prompt in enumerate(active):
                for j in range(n):
                    if ends[g, j]:
                        entry = extended(cand_rows[g, j].item(), cand_tokens[g, j].item(), cand_logprob[g, j].item())
                        last_token = entry["tokens"][-1]
                        reason = EOS if last_token == self.eos else STOP if last_token in self.stop.single_tokens else LENGTH
                        score = cand_scores[g, j].item() / (gen_len ** self.options.length_penalty)
                        finished[prompt].append(self.hypothesis(entry["tokens"], entry["scores"], entry["tops"], reason, score))
                finished[prompt] = sorted(finished[prompt], key=lambda h: -h["score"])[:n]
            going_on = cand_scores + ends.float() * NOT_A_BEAM
            running, chosen = going_on.topk(n, dim=-1)  # (G, n)
            next_rows = cand_rows.gather(1, chosen)
            next_tokens = cand_tokens.gather(1, chosen)
            # Hugging Face's early stop: a prompt is done once n beams have finished and the best
            # running beam, scored at the current length, cannot beat the worst of them.
            keep = [g for g, prompt in enumerate(active)
                    if not last_step[g] and (
                        len(finished[prompt]) < n
                        or running[g, 0].item() / (gen_len ** self.options.length_penalty) > finished[prompt][-1]["score"])]
            if not keep:
                break
            order = next_rows[keep].flatten()
            chosen_tokens = next_tokens[keep].flatten()
            rows_cpu, tokens_cpu = order.tolist(), chosen_tokens.tolist()
            logprobs_cpu = allowed[order, chosen_tokens].tolist()
            history = {
                "tokens": [history["tokens"][r] + [t] for r, t in zip(rows_cpu, tokens_cpu)],
                "scores": [history["scores"][r] + [s] for r, s in zip(rows_cpu, logprobs_cpu)],
                "tops": [history["tops"][r] + ([(top_values[r], top_ids[r])] if self.options.logprobs else [])
                         for r in rows_cpu],
            }
            tokens = torch.cat([tokens.index_select(0, order), chosen_tokens[:, None]], dim=1)
            self.decoder.reorder_incremental_state(state, order)
            running = running[keep]
            active = [active[g] for g in keep]
            lprobs = self._step(tokens, state)
        return finished

    # -- echo -----------------------------------------------------------------------------------

    def _score_prompts(self, features, extra, tokens, prompts, right_padded: bool) -> List[Dict[str, torch.Tensor]]:
        """Log-probability of each prompt token given the ones before it (the first has none);
        `tokens` hold the prompts left-padded, or right-padded."""
        logits = self.decoder.output_layer(features)
        lprobs = self.decoder.get_normalized_probs((logits, extra), log_probs=True)  # (B, T, V)
        width = tokens.size(1)
        infos = []
        for row, prompt in enumerate(prompts):
            start = 0 if right_padded else width - len(prompt)
            end = start + len(prompt)
            predicted = lprobs[row, start:end - 1]  # predictions for prompt tokens 1 .. L-1
            targets = tokens[row, start + 1:end]
            info = {"prompt_tokens": torch.tensor(prompt, dtype=torch.long),
                    "prompt_scores": torch.cat([torch.tensor([math.nan]),
                                                predicted.gather(1, targets[:, None]).squeeze(1).cpu()])}
            if self.options.logprobs:
                values, ids = predicted.topk(self.options.logprobs, dim=-1)
                info["prompt_top_logprobs"], info["prompt_top_tokens"] = values.cpu(), ids.cpu()
            infos.append(info)
        return infos
