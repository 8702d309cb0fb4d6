"""`GeneratorInterface`: text in, metaseq's completion dicts out, from a metaseq_ds checkpoint.

    generator = GeneratorInterface("checkpoints")  # a save dir, or a checkpoint_<epoch>_<updates> dir
    generator.load_model()
    options = GenerationOptions(max_tokens=32, temperature=0.7, top_p=0.9, seed=1)
    [[result]] = generator.generate(["The model reads"], options=options)
    # or metaseq's keywords: generator.generate(["The model reads"], max_tokens=[32], temperature=0.7, top_p=0.9)
    result["text"], result["tokens"], result["text_offset"], result["token_scores"],
    result["top_logprobs"], result["finish_reason"]

The checkpoint may have been saved by any number of ranks: ZeRO and tensor-parallel shards are
gathered (`checkpoint.read.load_model_weights`). Under a launcher (WORLD_SIZE > 1) the model is
then sharded across the ranks with the tensor-parallel plan: every rank runs the same decoding
loop on its shard, with the logits gathered, so all ranks choose the same tokens (sampling
uses one seed, rank 0's when none is given). Prompts are text (encoded, after the </s>
that separates documents in training, as OPT's tokenizer does) or lists of token ids (used
as given). The result of a text prompt leaves special tokens out; that of a token-id prompt has
one entry per token, every id it gave (with `echo`) and every token chosen, </s> included, as
vLLM's has: a client aligns the log-probabilities with the ids it sent (lm-evaluation-harness
reads a continuation's as `token_logprobs[context_length:-1]`). A prompt must leave room for
at least one new token in the model's positions; a longer one is refused, not truncated, and
generation stops at the last position (finish_reason "length") when `max_tokens` would run past it.

Decoding: temperature 0 is greedy, or beam search over `best_of` beams returning the best `n`
(length penalty `length_penalty`); temperature > 0 samples `best_of` completions per prompt
(top-k, top-p) and returns the `n` with the best score (mean log-probability per token).
"""

import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Union

from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions

logger = logging.getLogger("metaseq_ds.hub_utils")

Prompt = Union[str, Sequence[int]]
LIMITS = ("min_tokens", "max_tokens")


class TextIds(list):
    """The token ids `encode` made of a text prompt (the </s> it put first, then the text's
    tokens): a list that remembers it was text, so that its result leaves the </s> out however
    the ids travel to `generate` (the server encodes a request's prompts before batching them)."""


class GeneratorInterface:
    """Generation from one checkpoint (`path`), or from a model and task already in memory."""

    def __init__(self, path: Optional[str] = None, model=None, task=None, compile: Optional[bool] = None):
        """`compile`: compile the decoding step (see `static_decoding.should_compile`; None: on CUDA only)."""
        if (path is None) == (model is None):
            raise ValueError("give either a checkpoint path or a model and its task")
        self.path = path
        self.model, self.task = model, task
        self.compile = compile

    def load_model(self):
        """Load the checkpoint (once); returns `[model]` as metaseq's did."""
        if self.model is None:
            from metaseq_ds.checkpoint.inference import load_model_for_inference

            ranks = _launched_ranks()
            if ranks > 1:
                from metaseq_ds.distributed import utils as dist_utils

                dist_utils.init_distributed(tensor_parallel_size=ranks)
            # Under a launcher each rank builds its tensor-parallel shard and reads only its part.
            cfg, self.task, self.model, ref = load_model_for_inference(self.path, need_data=False)
            # Loaded here for generation only: inference mode and the decoding weight layout.
            self.model.make_generation_fast_()
            logger.info("loaded %s", ref.path)
        return [self.model]

    @property
    def tokenizer(self):
        return self.task.tokenizer

    @property
    def dictionary(self):
        return self.task.dictionary

    def max_positions(self) -> int:
        decoder = self.model.decoder if hasattr(self.model, "decoder") else self.model
        return decoder.max_positions()

    def encode(self, prompt: Prompt, index: int) -> List[int]:
        """Token ids of a prompt: text after </s> (a document start; `TextIds`), or ids as given."""
        if isinstance(prompt, str):
            if not prompt:
                raise UsageError(f"prompt {index + 1} is empty")
            ids = [self.dictionary.eos()] + self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            if not ids:
                raise UsageError(f"prompt {index + 1} has no tokens")
            bad = [t for t in ids if not 0 <= t < len(self.dictionary)]
            if bad:
                raise UsageError(f"prompt {index + 1}: token id {bad[0]} is outside the vocabulary (0..{len(self.dictionary) - 1})")
        if len(ids) >= self.max_positions():
            raise UsageError(
                f"prompt {index + 1} has {len(ids)} tokens; the model takes {self.max_positions()} positions "
                f"in all, so a prompt may have at most {self.max_positions() - 1} (shorten it)"
            )
        return TextIds(ids) if isinstance(prompt, (str, TextIds)) else ids

    def generate(
        self,
        inputs: Sequence[Prompt],
        min_tokens: Union[int, Sequence[int], None] = None,
        max_tokens: Union[int, Sequence[int], None] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        n: Optional[int] = None,
        best_of: Optional[int] = None,
        logprobs: Optional[int] = None,
        echo: Optional[bool] = None,
        stop: Union[str, Sequence[Union[str, int, Sequence[int]]], None] = None,
        seed: Optional[int] = None,
        length_penalty: Optional[float] = None,
        stream: Optional[Callable[[int, int], None]] = None,
        *,
        options: Union[GenerationOptions, Sequence[GenerationOptions], None] = None,
    ) -> List[List[Dict]]:
        """For each prompt, `n` result dicts (best first), decoded as `options` say: one object,
        or one per prompt that differ only in `min_tokens`/`max_tokens` (the prompts still decode
        in one batch, each to its own length).

        Instead of `options`, metaseq's keywords: the `GenerationOptions` fields, None for the
        field's default; `min_tokens`/`max_tokens` may also be one value per prompt. `stop`:
        strings (may span several tokens) or token ids. `stream(prompt_index, token_id)` sees
        sampled/greedy tokens as they are chosen."""
        from metaseq_ds.sequence_generator import SequenceGenerator

        keywords = dict(min_tokens=min_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, n=n, best_of=best_of, logprobs=logprobs, echo=echo, stop=stop, seed=seed,
                        length_penalty=length_penalty)
        given = {k: v for k, v in keywords.items() if v is not None}
        if options is not None and given:
            raise TypeError(f"give generate() options= or the sampling keywords, not both: {sorted(given)}")
        if options is None:
            # metaseq's API also takes one limit per prompt: such lists are checked prompt by prompt.
            per_prompt = any(not isinstance(given.get(k, 0), int) for k in LIMITS)
            shared = GenerationOptions.from_values({k: v for k, v in given.items() if not (per_prompt and k in LIMITS)})
            mins = _per_prompt(min_tokens, shared.min_tokens, len(inputs), "min_tokens")
            maxs = _per_prompt(max_tokens, shared.max_tokens, len(inputs), "max_tokens")
            options = [shared.replace(min_tokens=least, max_tokens=most) for least, most in zip(mins, maxs)]
        elif isinstance(options, GenerationOptions):
            options = [options] * len(inputs)
        elif len(options) != len(inputs):
            raise TypeError(f"generate() got {len(options)} options for {len(inputs)} prompts")
        if not inputs:
            raise UsageError("no prompts given")
        shared = _shared(options)

        self.load_model()
        if _launched_ranks() > 1:
            seed = shared.seed if shared.seed is not None else int.from_bytes(os.urandom(4), "little")
            shared = shared.replace(seed=_rank0_value(seed))
        prompts = [self.encode(p, i) for i, p in enumerate(inputs)]
        generator = SequenceGenerator([self.model], self.dictionary, shared, decode=self.tokenizer.decode,
                                      compile=self.compile)
        hypos = generator.generate([self.model], prompts, stream=stream, min_tokens=[o.min_tokens for o in options],
                                   max_tokens=[o.max_tokens for o in options])
        return [[self.result(h, shared, isinstance(prompt, TextIds)) for h in prompt_hypos]
                for prompt, prompt_hypos in zip(prompts, hypos)]

    def result(self, hypo: Dict, options: GenerationOptions, text_prompt: bool) -> Dict:
        """metaseq's result dict for one hypothesis, the stop text cut; special tokens dropped
        for a text prompt, every token kept for a token-id prompt (their text is empty)."""
        stop_strings = [s for s in options.stop if isinstance(s, str)]
        stop_ids = [s for s in options.stop if not isinstance(s, str)]
        tokens = hypo["tokens"].tolist()
        scores = hypo["positional_scores"].tolist()
        tops = _top_lists(hypo, "top") if options.logprobs else None
        reason = hypo["finish_reason"]
        if reason == "stop":
            for sequence in ([s] if isinstance(s, int) else list(s) for s in stop_ids):
                if tokens[-len(sequence):] == sequence:
                    del tokens[-len(sequence):], scores[-len(sequence):]
                    if tops is not None:
                        del tops[-len(sequence):]
                    break
        prompt = hypo["prompt_tokens"].tolist() if options.echo else []
        if options.echo:
            tokens = prompt + tokens
            scores = [None] + hypo["prompt_scores"].tolist()[1:] + scores
            if tops is not None:
                tops = [None] + _top_lists(hypo, "prompt_top") + tops
        dropped = self.special_ids() if text_prompt else set()
        keep = [i for i, t in enumerate(tokens) if t not in dropped]
        prompt_kept = sum(1 for t in prompt if t not in dropped)
        tokens = [tokens[i] for i in keep]
        scores = [scores[i] for i in keep]
        tops = [tops[i] for i in keep] if tops is not None else None

        pieces = [self.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
        text, offsets = pieces[-1], [len(p) for p in pieces[:-1]]
        start = len(pieces[prompt_kept])  # stop strings are looked for in the completion only
        cut = min((at for at in (text.find(s, start) for s in stop_strings) if at >= 0), default=None)
        if cut is not None:
            # Stop strings also cut finished beams, which they do not steer.
            reason = "stop"
            text = text[:cut]
            count = sum(1 for o in offsets if o < cut)
            tokens, scores, offsets = tokens[:count], scores[:count], offsets[:count]
            tops = tops[:count] if tops is not None else None
        return {
            "text": text,
            "tokens": [self.tokenizer.decode([t]) for t in tokens],
            "text_offset": offsets,
            "token_scores": scores,
            "top_logprobs": (
                [None if top is None else {self.tokenizer.decode([t]): v for t, v in top} for top in tops]
                if tops is not None else None
            ),
            "finish_reason": reason,
        }

    def special_ids(self):
        """Ids that never appear in result text: <s>, <pad>, </s>, <unk>."""
        d = self.dictionary
        return {d.bos(), d.pad(), d.eos(), d.unk()}


def _per_prompt(value, default: int, count: int, name: str) -> List[int]:
    if value is None:
        return [default] * count
    if isinstance(value, int):
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise UsageError(f"{name}: {len(values)} values for {count} prompts")
    return values


def _shared(options: Sequence[GenerationOptions]) -> GenerationOptions:
    """The options of one batch: per-prompt options may differ in their limits only."""
    first = options[0].model_dump(exclude=set(LIMITS))
    for other in options[1:]:
        if other.model_dump(exclude=set(LIMITS)) != first:
            raise TypeError("the options of one generate() call may differ only in min_tokens and max_tokens")
    return options[0]


def _top_lists(hypo: Dict, prefix: str) -> List[List]:
    """Per position, [(token_id, logprob), ...] of the k most likely tokens."""
    return [list(zip(ids, values)) for ids, values in
            zip(hypo[f"{prefix}_tokens"].tolist(), hypo[f"{prefix}_logprobs"].tolist())]


def _launched_ranks() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _rank0_value(value: int) -> int:
    """`value` as rank 0 has it: the ranks of a sharded model must draw the same samples."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=0)
    return int(tensor.item())
