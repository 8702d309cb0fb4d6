"""`GeneratorInterface`: text in, metaseq's completion dicts out, from a metaseq_ds checkpoint.

    generator = GeneratorInterface("checkpoints")  # a save dir, or a checkpoint_<epoch>_<updates> dir
    generator.load_model()
    [[result]] = generator.generate(["The model reads"], max_tokens=[32], temperature=0.7, top_p=0.9, seed=1)
    result["text"], result["tokens"], result["text_offset"], result["token_scores"],
    result["top_logprobs"], result["finish_reason"]

The checkpoint may have been saved by any number of ranks: ZeRO and tensor-parallel shards are
gathered (`checkpoint_utils.load_model_weights`). Under a launcher (WORLD_SIZE > 1) the model is
then sharded across the ranks with the tensor-parallel plan: every rank runs the same decoding
loop on its shard, with the logits gathered, so all ranks choose the same tokens (sampling
uses one seed, rank 0's when none is given). Prompts are text (encoded, after the </s>
that separates documents in training, as OPT's tokenizer does) or lists of token ids (used
as given). A prompt must leave room for at least one new token in the model's positions; a
longer one is refused, not truncated, and generation stops at the last position
(finish_reason "length") when `max_tokens` would run past it.

Decoding: temperature 0 is greedy, or beam search over `best_of` beams returning the best `n`
(length penalty `length_penalty`); temperature > 0 samples `best_of` completions per prompt
(top-k, top-p) and returns the `n` with the best score (mean log-probability per token).
"""

import logging
import os
from typing import Callable, Dict, List, Optional, Sequence, Union

from metaseq_ds.errors import UsageError

logger = logging.getLogger("metaseq_ds.hub_utils")

Prompt = Union[str, Sequence[int]]


class GeneratorInterface:
    """Generation from one checkpoint (`path`), or from a model and task already in memory."""

    def __init__(self, path: Optional[str] = None, model=None, task=None):
        if (path is None) == (model is None):
            raise ValueError("give either a checkpoint path or a model and its task")
        self.path = path
        self.model, self.task = model, task

    def load_model(self):
        """Load the checkpoint (once); returns `[model]` as metaseq's did."""
        if self.model is None:
            from metaseq_ds import checkpoint_utils

            ranks = _launched_ranks()
            if ranks > 1:
                from metaseq_ds.distributed import utils as dist_utils

                dist_utils.init_distributed(tensor_parallel_size=ranks)
            cfg, self.task, self.model, ref = checkpoint_utils.load_model_for_inference(self.path, need_data=False)
            if ranks > 1:
                from metaseq_ds.distributed.tensor_parallel import apply_tensor_parallel, check_divisible

                check_divisible(cfg.model, ranks, source="the number of ranks,")
                apply_tensor_parallel(self.model, gather_logits=True)
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
        """Token ids of a prompt: text after </s> (a document start), or ids as given."""
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
        return ids

    def generate(
        self,
        inputs: Sequence[Prompt],
        min_tokens: Union[int, Sequence[int], None] = None,
        max_tokens: Union[int, Sequence[int], None] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        n: int = 1,
        best_of: Optional[int] = None,
        logprobs: int = 0,
        echo: bool = False,
        stop: Optional[Sequence[Union[str, int]]] = None,
        seed: Optional[int] = None,
        length_penalty: float = 1.0,
        stream: Optional[Callable[[int, int], None]] = None,
    ) -> List[List[Dict]]:
        """For each prompt, `n` result dicts (best first). `min_tokens`/`max_tokens`: one value or
        one per prompt (default 0 / 32). `stop`: strings (may span several tokens) or token ids.
        `stream(prompt_index, token_id)` sees sampled/greedy tokens as they are chosen."""
        from metaseq_ds.sequence_generator import SequenceGenerator

        self.load_model()
        if _launched_ranks() > 1:
            seed = _rank0_value(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
        best_of = n if best_of is None else best_of
        if n < 1 or best_of < n:
            raise UsageError(f"need 1 <= n <= best_of, got n={n}, best_of={best_of}")
        if logprobs < 0:
            raise UsageError(f"logprobs must be >= 0, got {logprobs}")
        if not inputs:
            raise UsageError("no prompts given")
        prompts = [self.encode(p, i) for i, p in enumerate(inputs)]
        mins = _per_prompt(min_tokens, 0, len(prompts), "min_tokens")
        maxs = _per_prompt(max_tokens, 32, len(prompts), "max_tokens")
        stop = list(stop or [])
        stop_strings = [s for s in stop if isinstance(s, str)]
        stop_ids = [s for s in stop if not isinstance(s, str)]
        beam = best_of if temperature == 0 else 1
        copies = 1 if temperature == 0 else best_of

        results: List[List[Dict]] = [[] for _ in prompts]
        # One generator per distinct (min, max): metaseq's API allows them per prompt.
        for limits in sorted(set(zip(mins, maxs))):
            indices = [i for i in range(len(prompts)) if (mins[i], maxs[i]) == limits]
            generator = SequenceGenerator(
                [self.model], self.dictionary, beam_size=beam, max_new_tokens=limits[1], min_new_tokens=limits[0],
                temperature=temperature, topp=top_p, topk=top_k, length_penalty=length_penalty, stop=stop_ids,
                stop_strings=stop_strings, decode=self.tokenizer.decode, need_logprobs=logprobs > 0,
                logprobs_topk=logprobs, echo=echo, seed=seed,
            )
            batch = [prompts[i] for i in indices for _ in range(copies)]
            def row_stream(row, token, indices=indices):
                stream(indices[row // copies], token)

            hypos = generator.generate([self.model], batch, stream=row_stream if stream is not None else None)
            for k, i in enumerate(indices):
                candidates = [h for row in hypos[k * copies:(k + 1) * copies] for h in row]
                candidates.sort(key=lambda h: -h["score"])
                results[i] = [self._result(h, stop_strings, stop_ids, echo, logprobs) for h in candidates[:n]]
        return results

    def _result(self, hypo: Dict, stop_strings: List[str], stop_ids: List, echo: bool, logprobs: int) -> Dict:
        """metaseq's result dict for one hypothesis: special tokens dropped, the stop text cut."""
        tokens = hypo["tokens"].tolist()
        scores = hypo["positional_scores"].tolist()
        tops = _top_lists(hypo, "top") if logprobs else None
        reason = hypo["finish_reason"]
        if reason == "stop":
            for sequence in ([s] if isinstance(s, int) else list(s) for s in stop_ids):
                if tokens[-len(sequence):] == sequence:
                    del tokens[-len(sequence):], scores[-len(sequence):]
                    if tops is not None:
                        del tops[-len(sequence):]
                    break
        if echo:
            tokens = hypo["prompt_tokens"].tolist() + tokens
            scores = [None] + hypo["prompt_scores"].tolist()[1:] + scores
            if tops is not None:
                tops = [None] + _top_lists(hypo, "prompt_top") + tops
        specials = self.special_ids()
        keep = [i for i, t in enumerate(tokens) if t not in specials]
        prompt_kept = sum(1 for t in hypo["prompt_tokens"].tolist() if t not in specials) if echo else 0
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
