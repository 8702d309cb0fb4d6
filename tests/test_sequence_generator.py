"""SequenceGenerator and GeneratorInterface: Hugging Face parity for greedy and beam search,
sampling masks and seeds, stops, finish reasons, logprobs, echo, batching."""

import copy
import math

import pytest
import torch
from torch import nn

from metaseq_ds.data import Dictionary
from metaseq_ds.data.tokenizers import ByteTokenizer
from metaseq_ds.errors import UsageError
from metaseq_ds.hub_utils import GeneratorInterface
from metaseq_ds.models.base import BaseDecoder
from metaseq_ds.sequence_generator import SequenceGenerator, left_pad, top_k_mask, top_p_mask
from test_hf_parity import PAD, TinyDictionary, build_pair


def FrequentEosDictionary(token: int):
    """eos = `token`, one the tiny random model often prefers (`frequent_token`), so that beams
    end early and the finished-beam bookkeeping is exercised, not only the length limit."""
    dictionary = TinyDictionary()
    dictionary.eos_index = token
    return dictionary


def _prompts(seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 40, (length,), generator=generator).tolist() for length in (5, 3, 7)]


@pytest.fixture(scope="module")
def pair():
    _, ours, hf, _ = build_pair("pre_ln_relu_tied")
    return ours, hf


BEAM_CASES = [(1, 1.0), (3, 1.0), (4, 0.5), (2, 2.0)]


@pytest.fixture(scope="module")
def frequent_token(pair):
    """A token the random model often chooses after the test prompts, such that used as eos it
    ends some completions and not others in every beam case (so both endings are compared).
    Found from the model, not hard-coded: which token that is depends on the initial weights."""
    ours, _ = pair
    counts = {}
    for seed in range(4):
        for [hypo] in SequenceGenerator([ours], TinyDictionary(), max_new_tokens=9, temperature=0).generate([ours], _prompts(seed)):
            for token in hypo["tokens"].tolist():
                counts[token] = counts.get(token, 0) + 1

    def ends_both_ways(token):
        for beams, length_penalty in BEAM_CASES:
            generator = SequenceGenerator([ours], FrequentEosDictionary(token), beam_size=beams, max_new_tokens=9,
                                          temperature=0, length_penalty=length_penalty)
            reasons = {hypos[0]["finish_reason"] for seed in range(4) for hypos in generator.generate([ours], _prompts(seed))}
            if not {"eos", "length"} <= reasons:
                return False
        return True

    return next(token for token in sorted(counts, key=counts.get, reverse=True) if ends_both_ways(token))


@pytest.mark.parametrize("generation_fast", [False, True], ids=["as_trained", "generation_fast"])
@pytest.mark.parametrize("beams, length_penalty", BEAM_CASES)
def test_greedy_and_beam_search_equal_hugging_face_generate(pair, frequent_token, beams, length_penalty, generation_fast):
    ours, hf = pair
    if generation_fast:
        ours = copy.deepcopy(ours)
        ours.make_generation_fast_()
    reasons = []
    for seed in range(4):
        prompts = _prompts(seed)
        batch = left_pad(prompts, PAD)
        theirs = hf.generate(batch, attention_mask=batch.ne(PAD).long(), max_new_tokens=9, do_sample=False,
                             num_beams=beams, length_penalty=length_penalty, suppress_tokens=[PAD],
                             pad_token_id=PAD, eos_token_id=frequent_token)
        generator = SequenceGenerator([ours], FrequentEosDictionary(frequent_token), beam_size=beams, max_new_tokens=9,
                                      temperature=0, length_penalty=length_penalty)
        hypos = generator.generate([ours], prompts)
        for row, row_hypos in enumerate(hypos):
            expected = theirs[row, batch.size(1):].tolist()
            while expected and expected[-1] == PAD:
                expected.pop()
            assert row_hypos[0]["tokens"].tolist() == expected, (seed, row)
            assert len(row_hypos) == beams
            reasons.append(row_hypos[0]["finish_reason"])
    assert {"eos", "length"} <= set(reasons)  # both endings were compared


def test_batched_prompts_of_different_lengths_equal_one_by_one(pair):
    ours, _ = pair
    prompts = _prompts(7)
    generator = SequenceGenerator([ours], TinyDictionary(), max_new_tokens=8, temperature=0, need_logprobs=True)
    batched = generator.generate([ours], prompts)
    for prompt, [hypo] in zip(prompts, batched):
        [[alone]] = generator.generate([ours], [prompt])
        assert hypo["tokens"].tolist() == alone["tokens"].tolist()
        torch.testing.assert_close(hypo["positional_scores"], alone["positional_scores"], atol=1e-5, rtol=1e-5)


def test_scores_and_top_logprobs_are_the_models_log_probabilities(pair):
    ours, _ = pair
    prompt = _prompts(3)[0]
    generator = SequenceGenerator([ours], TinyDictionary(), max_new_tokens=6, temperature=0,
                                  need_logprobs=True, logprobs_topk=3, echo=True)
    [[hypo]] = generator.generate([ours], [prompt])
    sequence = torch.tensor([prompt + hypo["tokens"].tolist()])
    with torch.no_grad():
        lprobs = torch.log_softmax(ours(sequence)[0][0], dim=-1)  # (T, V), full forward
    expected = lprobs[:-1].gather(1, sequence[0, 1:, None]).squeeze(1)
    scores = torch.cat([hypo["prompt_scores"][1:], hypo["positional_scores"]])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert math.isnan(hypo["prompt_scores"][0])
    top = torch.cat([hypo["prompt_top_logprobs"], hypo["top_logprobs"]])
    torch.testing.assert_close(top, lprobs[:-1].topk(3, dim=-1).values, atol=1e-5, rtol=1e-5)
    assert hypo["top_tokens"][:, 0].tolist() == hypo["tokens"].tolist()  # greedy picks the top token


def test_min_new_tokens_holds_back_eos(pair, frequent_token):
    ours, _ = pair
    eos = FrequentEosDictionary(frequent_token)
    ended = [[p] for seed in range(4) for p in _prompts(seed)
             if SequenceGenerator([ours], eos, max_new_tokens=12, temperature=0).generate([ours], [p])[0][0]["finish_reason"] == "eos"]
    prompt = min(ended, key=lambda p: len(SequenceGenerator([ours], eos, max_new_tokens=12, temperature=0).generate([ours], p)[0][0]["tokens"]))
    free = SequenceGenerator([ours], eos, max_new_tokens=12, temperature=0).generate([ours], prompt)
    assert free[0][0]["finish_reason"] == "eos"
    at_least = len(free[0][0]["tokens"]) + 2
    held = SequenceGenerator([ours], eos, max_new_tokens=12, min_new_tokens=at_least,
                             temperature=0).generate([ours], prompt)
    assert frequent_token not in held[0][0]["tokens"][:at_least].tolist()
    assert len(held[0][0]["tokens"]) > at_least - 2


def test_sampling_with_a_seed_is_reproducible(pair):
    ours, _ = pair
    prompts = _prompts(1)

    def sample(seed):
        generator = SequenceGenerator([ours], TinyDictionary(), max_new_tokens=12, temperature=1.5, topp=0.95,
                                      topk=20, seed=seed)
        return [row[0]["tokens"].tolist() for row in generator.generate([ours], prompts)]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_top_k_mask_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    masked = top_k_mask(logits, 2)
    assert torch.isfinite(masked).tolist() == [[False, True, True, False, False]]
    assert torch.equal(top_k_mask(logits, 0), logits)


def test_top_p_mask_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.5, 0.3, 0.1]])
    logits = probs.log()
    assert torch.isfinite(top_p_mask(logits, 0.5)).tolist() == [[False, True, False, False]]
    assert torch.isfinite(top_p_mask(logits, 0.75)).tolist() == [[False, True, True, False]]
    kept = torch.isfinite(top_p_mask(logits, 0.85))[0]  # 0.5 + 0.3 + one of the two 0.1s
    assert kept[1] and kept[2] and kept.sum() == 3
    assert torch.isfinite(top_p_mask(logits, 1.0)).all()


def test_sampling_follows_the_masked_distribution():
    # A decoder whose next-token distribution is fixed: counts show what top-k / top-p allowed.
    decoder = FixedDistributionDecoder(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.4, 0.3, 0.2, 0.1]))
    dictionary = FixedDictionary()
    counts = torch.zeros(8)
    for topk, topp in ((0, 0.6), (3, 1.0)):
        generator = SequenceGenerator([decoder], dictionary, max_new_tokens=1, temperature=1.0, topk=topk, topp=topp, seed=0)
        drawn = [row[0]["tokens"].item() for row in generator.generate([decoder], [[4]] * 2000)]
        counts = torch.bincount(torch.tensor(drawn), minlength=8).float()
        allowed = {4, 5} if topp == 0.6 else {4, 5, 6}
        assert set(torch.nonzero(counts).flatten().tolist()) == allowed
        expected = torch.tensor([0.4, 0.3, 0.2, 0.1])[: len(allowed)]
        observed = counts[4:4 + len(allowed)] / counts.sum()
        torch.testing.assert_close(observed, expected / expected.sum(), atol=0.04, rtol=0)


def FixedDictionary():
    return Dictionary.of_size(8)


class FixedDistributionDecoder(BaseDecoder):
    def __init__(self, probs):
        super().__init__(FixedDictionary())
        self.logits = nn.Parameter(torch.where(probs > 0, probs.log(), torch.tensor(-1e4)), requires_grad=False)

    def extract_features(self, prev_output_tokens, incremental_state=None, **unused):
        return self.logits.expand(prev_output_tokens.size(0), 1, -1), None

    def output_layer(self, features, **kwargs):
        return features


class ScriptedDecoder(BaseDecoder):
    """Emits `script` after the prompt, whatever the prompt: next-token logits are one-hot on
    script[number of tokens generated so far], read from the length of the incremental state."""

    def __init__(self, dictionary, script):
        super().__init__(dictionary)
        self.script = script
        self.anchor = nn.Parameter(torch.zeros(()), requires_grad=False)

    def extract_features(self, prev_output_tokens, incremental_state=None, **unused):
        saved = self.get_incremental_state(incremental_state, "prompt")
        if saved is None:
            saved = {"length": prev_output_tokens.size(1)}
            self.set_incremental_state(incremental_state, "prompt", saved)
        step = prev_output_tokens.size(1) - saved["length"]
        # The prompt call returns every position (echo scores them), later calls the new one.
        positions = prev_output_tokens.size(1) if step == 0 else 1
        logits = torch.full((prev_output_tokens.size(0), positions, len(self.dictionary)), -10.0)
        logits[:, :, self.script[min(step, len(self.script) - 1)]] = 10.0
        return logits, None

    def output_layer(self, features, **kwargs):
        return features

    def max_positions(self):
        return 100


class ByteTask:
    tokenizer = ByteTokenizer()

    class dictionary:  # noqa: N801 - a stand-in with Dictionary's interface
        @staticmethod
        def __len__():
            return 264

        bos, pad, eos, unk = (staticmethod(lambda i=i: i) for i in range(4))

    dictionary = dictionary()


def _scripted(text: str, end_with_eos: bool = True):
    script = ByteTask.tokenizer.encode(text) + ([2] if end_with_eos else [])
    return GeneratorInterface(model=ScriptedDecoder(ByteTask.dictionary, script), task=ByteTask())


def test_multi_token_stop_string_stops_there_and_is_cut_from_the_text():
    interface = _scripted("Hello world. Bye now")
    [[result]] = interface.generate(["Q:"], max_tokens=50, temperature=0, stop=["world."])
    assert result["text"] == "Hello "
    assert result["finish_reason"] == "stop"
    assert "".join(result["tokens"]) == "Hello "
    assert result["text_offset"] == list(range(6))
    hypos = []
    interface.generate(["Q:"], max_tokens=50, temperature=0, stop=["world."], stream=lambda i, t: hypos.append(t))
    assert ByteTask.tokenizer.decode(hypos) == "Hello world."  # generation stopped on the '.'


def test_stop_token_ids_and_finish_reasons():
    interface = _scripted("abc def")
    [[by_id]] = interface.generate(["x"], max_tokens=50, temperature=0, stop=ByteTask.tokenizer.encode(" "))
    assert (by_id["text"], by_id["finish_reason"]) == ("abc", "stop")
    [[ended]] = interface.generate(["x"], max_tokens=50, temperature=0)
    assert (ended["text"], ended["finish_reason"]) == ("abc def", "eos")
    [[cut]] = interface.generate(["x"], max_tokens=3, temperature=0)
    assert (cut["text"], cut["finish_reason"]) == ("abc", "length")


def test_echo_returns_the_prompt_with_scores():
    interface = _scripted("yz")
    [[result]] = interface.generate(["ab"], max_tokens=5, temperature=0, echo=True, logprobs=2)
    assert result["text"] == "abyz"
    assert result["tokens"] == ["a", "b", "y", "z"]
    # The prompt's leading </s> has no score and is dropped; "a" is scored given it.
    assert len(result["token_scores"]) == 4 and all(isinstance(v, float) for v in result["token_scores"])
    assert result["token_scores"][2] > -1e-3  # "y" was the scripted (certain) token
    assert [len(top) for top in result["top_logprobs"]] == [2, 2, 2, 2]


def test_n_and_best_of_return_the_best_samples(pair):
    ours, _ = pair
    interface = _interface_for(ours)
    results = interface.generate([[2, 5, 6], [2, 9]], max_tokens=[4, 6], temperature=1.0, n=2, best_of=5, seed=3)
    assert [len(r) for r in results] == [2, 2]
    for completions in results:
        means = [sum(c["token_scores"]) / len(c["token_scores"]) for c in completions]
        assert means == sorted(means, reverse=True)
    beams = interface.generate([[2, 5, 6]], max_tokens=4, temperature=0, n=2, best_of=3)
    assert len(beams[0]) == 2


def _interface_for(model):
    class Task:
        tokenizer = ByteTokenizer()
        dictionary = TinyDictionary()

    return GeneratorInterface(model=model, task=Task())


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"inputs": [""]}, "prompt 1 is empty"),
        ({"inputs": [[2] * 16]}, "prompt 1 has 16 tokens; the model takes 16 positions"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"n": 3, "best_of": 2}, "n <= best_of"),
    ],
)
def test_bad_requests_are_usage_errors(pair, kwargs, complaint):
    interface = _interface_for(pair[0])
    kwargs = {"inputs": [[2, 5]], **kwargs}
    with pytest.raises(UsageError, match=complaint):
        interface.generate(**kwargs)


def test_a_long_prompt_stops_at_the_last_position(pair):
    interface = _interface_for(pair[0])
    [[result]] = interface.generate([[2] + [5] * 12], max_tokens=10, temperature=0, min_tokens=3)
    assert result["finish_reason"] == "length" and len(result["token_scores"]) <= 3
