"""The static KV cache and the compiled decoding step: the cache's writes, mask, slots and
reordering; SequenceGenerator's static path against its incremental one (greedy, stops, limits,
logprobs, echo, seeded sampling) and Hugging Face's (tests/test_sequence_generator.py compares
greedy with HF generate, now through this path); the step compiled with inductor: same tokens,
one graph per bucket, no graph break, and eager after one warning where compiling fails."""

import warnings

import pytest
import torch

from metaseq_ds import static_decoding
from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.modules.kv_cache import StaticKVCache
from metaseq_ds.sequence_generator import SequenceGenerator, right_pad
from metaseq_ds.static_decoding import StaticDecoding
from metaseq_ds.models import TransformerLanguageModel, TransformerLanguageModelConfig
from test_hf_parity import OPT_LIKE, PAD, TinyDictionary, TinyTask, build_pair


@pytest.fixture(scope="module")
def model():
    _, ours, _, _ = build_pair("pre_ln_relu_tied")
    return ours


@pytest.fixture(scope="module")
def learned_and_sinusoidal(model):
    """OPT-like, and post-LN with sinusoidal positions and a projected embedding (350m-like)."""
    cfg = TransformerLanguageModelConfig(**{**OPT_LIKE, "decoder_learned_pos": False, "decoder_normalize_before": False,
                                            "decoder_input_dim": 16})
    torch.manual_seed(0)
    return [model, TransformerLanguageModel.build_model(cfg, TinyTask()).eval()]


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18], [19]]


def test_cache_writes_in_place_at_positions_and_masks_what_is_not_filled():
    cache = StaticKVCache(slots=2, capacity=6)
    keys = torch.arange(2 * 3 * 4, dtype=torch.float).view(2, 1, 3, 4)  # (B, nh, T, hs)
    positions = torch.tensor([[0, 1, 2], [0, 1, 2]])
    all_keys, all_values = cache.update(0, keys, -keys, positions)
    assert all_keys.shape == (2, 1, 6, 4)
    address = all_keys.data_ptr()
    torch.testing.assert_close(all_keys[:, :, :3], keys)
    assert all_keys[:, :, 3:].abs().sum() == 0  # zeros, never stale memory
    # One new key per slot, each at its own position.
    new = torch.full((2, 1, 1, 4), 7.0)
    all_keys, _ = cache.update(0, new, new, torch.tensor([[3], [5]]))
    assert all_keys.data_ptr() == address  # written in place, no copy
    assert all_keys[0, 0, 3].eq(7).all() and all_keys[1, 0, 5].eq(7).all() and all_keys[1, 0, 3].eq(0).all()
    mask = cache.attention_mask(torch.tensor([[3], [5]]))
    assert mask.shape == (2, 1, 1, 6)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 2
    assert mask[1, 0, 0].tolist() == [True] * 6


def test_reorder_moves_slots_in_place_and_clear_keeps_the_buffers():
    cache = StaticKVCache(slots=3, capacity=2)
    for layer in range(2):
        keys = torch.arange(3, dtype=torch.float).view(3, 1, 1, 1).expand(3, 1, 2, 1)
        cache.update(layer, keys, keys, torch.tensor([[0, 1]] * 3))
    address = cache.buffers_of(1)[0].data_ptr()
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.buffers_of(1)[0][:, 0, 0, 0].tolist() == [2.0, 2.0, 0.0]
    assert cache.buffers_of(1)[0].data_ptr() == address
    cache.clear()
    assert cache.buffers_of(0)[1].abs().sum() == 0 and cache.buffers_of(1)[0].data_ptr() == address


def test_a_prompt_prefilled_into_a_free_slot_decodes_as_in_one_batch(model):
    """What a continuous-batching scheduler does: prompts enter slots one at a time (here slots
    2 and 0 of 3, slot 1 unused); the next step over every slot gives each the same next-token
    log-probs as prefilling them together."""
    decoding = StaticDecoding(model.decoder, compile=False)
    prompts = [PROMPTS[0], PROMPTS[2]]
    together = decoding.cache(2, 16)
    tokens = right_pad(prompts, PAD)
    decoding.prefill(together, tokens)
    apart = StaticKVCache(slots=3, capacity=16)
    for prompt, slot in zip(prompts, (2, 0)):
        decoding.prefill(apart, torch.tensor([prompt]), slots=torch.tensor([slot]))
    next_tokens = torch.tensor([[21], [22]])
    lengths = torch.tensor([[len(p)] for p in prompts])
    ids = torch.tensor([PAD]), torch.tensor([2])
    expected, _, _ = decoding.step(together, next_tokens, lengths, *ids, torch.ones(2, dtype=torch.bool))
    got, _, _ = decoding.step(apart, torch.tensor([[22], [0], [21]]), torch.tensor([[len(prompts[1])], [0], [len(prompts[0])]]),
                              *ids, torch.ones(3, dtype=torch.bool))
    torch.testing.assert_close(got[[2, 0]], expected, atol=1e-5, rtol=1e-5)


def _decode(model, static_cache: bool, prompts=PROMPTS, compile=False, **options):
    generator = SequenceGenerator([model], TinyDictionary(), static_cache=static_cache, compile=compile,
                                  decode=lambda ids: " ".join(map(str, ids)), **options)
    return generator.generate([model], prompts)


def _same(static, incremental):
    for static_row, incremental_row in zip(static, incremental):
        assert len(static_row) == len(incremental_row)
        for ours, theirs in zip(static_row, incremental_row):
            assert ours["tokens"].tolist() == theirs["tokens"].tolist()
            assert ours["finish_reason"] == theirs["finish_reason"]
            torch.testing.assert_close(ours["positional_scores"], theirs["positional_scores"], atol=1e-5, rtol=1e-5)
            for key in ("top_tokens", "prompt_tokens"):
                if key in theirs:
                    assert ours[key].tolist() == theirs[key].tolist()
            for key in ("top_logprobs", "prompt_scores", "prompt_top_logprobs"):
                if key in theirs:
                    torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=1e-5, equal_nan=True)


GREEDY_CASES = {
    "plain": dict(max_new_tokens=12),
    "min_tokens": dict(max_new_tokens=12, min_new_tokens=6, stop=[30]),
    "stop_sequence_and_string": dict(max_new_tokens=20, stop=[(31, 32)], stop_strings=["33"]),
    "logprobs_and_echo": dict(max_new_tokens=9, need_logprobs=True, logprobs_topk=3, echo=True),
    "one_new_token": dict(max_new_tokens=1),
}


@pytest.mark.parametrize("case", sorted(GREEDY_CASES))
def test_greedy_on_the_static_cache_equals_the_incremental_path(learned_and_sinusoidal, case):
    for model in learned_and_sinusoidal:
        options = dict(temperature=0, **GREEDY_CASES[case])
        _same(_decode(model, True, **options), _decode(model, False, **options))


def test_greedy_ends_rows_on_the_models_frequent_token(model):
    """Rows end at different steps (eos = the token the model chooses most), between the reads
    of the device: each row stops at its own first eos."""
    first = _decode(model, True, temperature=0, max_new_tokens=30)
    frequent = max(range(4, 64), key=lambda t: sum(h[0]["tokens"].tolist().count(t) for h in first))
    dictionary = TinyDictionary()
    dictionary.eos_index = frequent
    runs = [SequenceGenerator([model], dictionary, static_cache=static, compile=False, temperature=0, max_new_tokens=30)
            .generate([model], PROMPTS) for static in (True, False)]
    _same(*runs)
    assert "eos" in {h[0]["finish_reason"] for h in runs[0]}
    assert len({len(h[0]["tokens"]) for h in runs[0]}) > 1  # the rows ended at different steps


def test_seeded_sampling_draws_the_same_tokens_as_the_incremental_path(model):
    options = GenerationOptions(temperature=0.9, top_k=20, top_p=0.95, seed=11, max_tokens=10, n=3, best_of=3)
    static, incremental = (SequenceGenerator([model], TinyDictionary(), options, static_cache=static_cache)
                           .generate([model], PROMPTS) for static_cache in (True, False))
    _same(static, incremental)
    per_prompt = SequenceGenerator([model], TinyDictionary(), temperature=0.9, seed=11, compile=False)
    limits = dict(min_tokens=[0, 2, 0, 1], max_tokens=[3, 9, 5, 1])
    _same(per_prompt.generate([model], PROMPTS, **limits),
          SequenceGenerator([model], TinyDictionary(), temperature=0.9, seed=11, static_cache=False)
          .generate([model], PROMPTS, **limits))


def test_streaming_sees_each_token_as_it_is_chosen(model):
    seen = []
    generator = SequenceGenerator([model], TinyDictionary(), temperature=0, max_new_tokens=5, compile=False)
    hypos = generator.generate([model], PROMPTS[:2], stream=lambda prompt, token: seen.append((prompt, token)))
    for prompt in range(2):
        assert [t for p, t in seen if p == prompt] == hypos[prompt][0]["tokens"].tolist()
    assert [p for p, _ in seen[:2]] == [0, 1]  # step by step, not prompt by prompt


def test_the_compiled_step_gives_the_eager_tokens_with_one_graph_per_bucket(model):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = _decode(model, True, temperature=0, max_new_tokens=12)
    compiled = _decode(model, True, compile=True, temperature=0, max_new_tokens=12)
    _same(compiled, eager)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1, "one graph for every step of the bucket (4 slots)"
    assert not counters["graph_break"], dict(counters["graph_break"])
    # Other prompts and lengths in the same bucket reuse it; a wider batch compiles its own.
    _same(_decode(model, True, prompts=PROMPTS[:3], compile=True, temperature=0, max_new_tokens=20),
          _decode(model, True, prompts=PROMPTS[:3], temperature=0, max_new_tokens=20))
    assert counters["stats"]["unique_graphs"] == graphs
    _decode(model, True, prompts=PROMPTS * 2, compile=True, temperature=0, max_new_tokens=3)
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_step_that_fails_to_compile_runs_eagerly_after_one_warning(model, monkeypatch):
    def broken_compile(self, step):
        def fails(*args):
            raise RuntimeError("inductor: no C++ compiler\nmore detail")
        return fails

    monkeypatch.setattr(StaticDecoding, "_compile", broken_compile)
    decoder = model.decoder
    saved = decoder.__dict__.pop("_static_decodings", None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = _decode(model, True, compile=True, temperature=0, max_new_tokens=6)
            second = _decode(model, True, compile=True, temperature=0, max_new_tokens=6)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "no C++ compiler" in messages[0] and "without compiling" in messages[0]
        eager = _decode(model, True, temperature=0, max_new_tokens=6)
        _same(first, eager)
        _same(second, eager)
    finally:
        decoder.__dict__.pop("_static_decodings", None)
        if saved is not None:
            decoder.__dict__["_static_decodings"] = saved


def test_buckets_round_rows_and_positions_up_only_when_compiling(model):
    limit = model.decoder.max_positions()
    compiled = StaticDecoding(model.decoder, compile=True)
    assert compiled.buckets(3, 5) == (4, min(static_decoding.SMALLEST_CAPACITY, limit))
    assert compiled.buckets(5, limit) == (8, limit)
    assert StaticDecoding(model.decoder, compile=False).buckets(3, 5) == (3, 5)
    assert static_decoding.power_of_two_at_least(129) == 256 and static_decoding.power_of_two_at_least(1) == 1
    assert static_decoding.should_compile(None, torch.device("cpu")) is False
    assert static_decoding.should_compile(None, torch.device("cuda")) is True
    assert static_decoding.should_compile(True, torch.device("cpu")) is True


def test_caches_are_reused_per_bucket_and_only_the_most_recent_are_kept(model):
    decoding = StaticDecoding(model.decoder, compile=False)
    first = decoding.cache(1, 8)
    assert decoding.cache(1, 8) is first  # the same bucket: the same buffers (a compiled step's)
    for rows in range(2, 2 + static_decoding.KEPT_CACHES):
        decoding.cache(rows, 8)
    assert len(decoding._caches) == static_decoding.KEPT_CACHES
    assert decoding.cache(1, 8) is not first  # the least recently used one had gone
