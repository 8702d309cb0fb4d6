"""Decoding as the server does it: several requests in one batch (the KV cache allocated once and
written in place, each prompt with its own min/max new tokens, as if decoded alone), and any
temperature a request may give."""

import pytest
import torch

from metaseq_ds.incremental_decoding_utils import reserve_positions
from metaseq_ds.modules.kv_cache import KVCache
from metaseq_ds.sequence_generator import SequenceGenerator
from test_hf_parity import TinyDictionary, build_pair
from test_sequence_generator import FrequentEosDictionary, _prompts, tokens_by_frequency

LIMITS = {"mins": [0, 4, 2], "maxs": [9, 5, 3]}  # new tokens of each of the 3 prompts


@pytest.fixture(scope="module")
def model():
    return build_pair("pre_ln_relu_tied")[1]


def _batched(model, eos: int, beams: int):
    generator = SequenceGenerator([model], FrequentEosDictionary(eos), beam_size=beams, temperature=0,
                                  need_logprobs=True)
    return generator.generate([model], _prompts(4), min_tokens=LIMITS["mins"], max_tokens=LIMITS["maxs"])


@pytest.fixture(scope="module")
def eos_token(model):
    """A token the random model often chooses, such that used as eos it ends some rows of the
    batch and not others, greedy and with beams (found from the model: it depends on the weights)."""
    def ends_both_ways(token):
        return all({"eos", "length"} <= {h["finish_reason"] for hypos in _batched(model, token, beams) for h in hypos}
                   for beams in (1, 3))

    return next(token for token in tokens_by_frequency(model) if ends_both_ways(token))


def _caches(state):
    return [entry["kv"] for entry in state.values() if isinstance(entry.get("kv"), KVCache)]


def test_a_reserved_cache_is_allocated_once_and_written_in_place(model):
    tokens = torch.randint(4, 40, (3, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(tokens)[0]
        state = {}
        reserve_positions(state, tokens.size(1))
        steps = [model(tokens[:, :6], incremental_state=state)[0]]
        buffers = [(cache.keys.data_ptr(), cache.values.data_ptr()) for cache in _caches(state)]
        assert len(buffers) == 2 and all(cache.keys.size(2) == 14 for cache in _caches(state))
        for end in range(7, tokens.size(1) + 1):
            steps.append(model(tokens[:, :end], incremental_state=state)[0])
        assert [(cache.keys.data_ptr(), cache.values.data_ptr()) for cache in _caches(state)] == buffers
        model.decoder.reorder_incremental_state(state, torch.tensor([2, 0]))  # rows leave: same buffers
        assert [(cache.keys.data_ptr(), cache.values.data_ptr()) for cache in _caches(state)] == buffers
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_an_unreserved_cache_grows_and_keeps_what_it_held():
    keys = torch.randn(2, 3, 4, 5)
    cache = KVCache(keys, -keys, capacity=0)
    more = torch.randn(2, 3, 1, 5)
    for _ in range(6):
        all_keys, all_values = cache.append(more, -more)
    assert cache.length == 10 and cache.keys.size(2) >= 10
    torch.testing.assert_close(all_keys, torch.cat([keys] + [more] * 6, dim=2))
    torch.testing.assert_close(all_values, -all_keys)
    cache.select_rows(torch.tensor([1, 1, 0]))  # more rows than before: new buffers
    torch.testing.assert_close(cache.keys[:, :, :10], torch.cat([keys] + [more] * 6, dim=2)[[1, 1, 0]])


@pytest.mark.parametrize("beams", [1, 3], ids=["greedy", "beam"])
def test_each_prompt_keeps_its_own_limits_in_one_batch(model, eos_token, beams):
    batched = _batched(model, eos_token, beams)
    reasons = set()
    for prompt, least, most, hypos in zip(_prompts(4), LIMITS["mins"], LIMITS["maxs"], batched):
        alone = SequenceGenerator([model], FrequentEosDictionary(eos_token), beam_size=beams, temperature=0,
                                  need_logprobs=True, min_new_tokens=least, max_new_tokens=most)
        expected = alone.generate([model], [prompt])[0]
        assert [h["tokens"].tolist() for h in hypos] == [h["tokens"].tolist() for h in expected]
        assert [h["finish_reason"] for h in hypos] == [h["finish_reason"] for h in expected]
        for mine, theirs in zip(hypos, expected):
            torch.testing.assert_close(mine["positional_scores"], theirs["positional_scores"], atol=1e-5, rtol=1e-5)
        assert all(least <= len(h["tokens"]) <= most for h in hypos)
        reasons |= {h["finish_reason"] for h in hypos}
    assert reasons == {"eos", "length"}  # rows ended both ways, at their own limits


def test_a_temperature_too_small_for_float32_samples_the_greedy_tokens(model):
    prompts = _prompts(5)
    greedy = SequenceGenerator([model], TinyDictionary(), temperature=0, max_new_tokens=6)
    tiny = SequenceGenerator([model], TinyDictionary(), temperature=1e-300, max_new_tokens=6, seed=1)
    expected = [h[0]["tokens"].tolist() for h in greedy.generate([model], prompts)]
    assert [h[0]["tokens"].tolist() for h in tiny.generate([model], prompts)] == expected
