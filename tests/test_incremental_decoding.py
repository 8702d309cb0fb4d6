"""The KV cache: incremental decoding gives a full forward's logits, reordering follows the rows,
and a decoder written against the fairseq-style API (its own cache) plugs into the generator."""

import pytest
import torch
from torch import nn

from metaseq_ds.incremental_decoding_utils import IncrementalState, with_incremental_state
from metaseq_ds.models.base import BaseDecoder
from metaseq_ds.sequence_generator import SequenceGenerator
from test_hf_parity import PAD, TinyDictionary, build_pair


def _tokens(left_pad: bool):
    tokens = torch.randint(4, 40, (3, 14), generator=torch.Generator().manual_seed(5))
    if left_pad:
        tokens[0, :6] = PAD
        tokens[2, :1] = PAD
    return tokens


@pytest.mark.parametrize("variant", ["pre_ln_relu_tied", "post_ln_projected_like_350m"])
@pytest.mark.parametrize("left_pad", [False, True], ids=["plain", "left_padded"])
@pytest.mark.parametrize("generation_fast", [False, True], ids=["as_trained", "generation_fast"])
def test_incremental_logits_equal_full_forward_at_every_step(variant, left_pad, generation_fast):
    _, model, _, _ = build_pair(variant)
    tokens = _tokens(left_pad)
    real = tokens.ne(PAD)
    prompt = 7
    with torch.no_grad():
        full = model(tokens)[0]  # (B, T, V)
        if generation_fast:  # the decoding steps then read the weights laid out for them
            model.make_generation_fast_()
        state = {}
        first = model(tokens[:, :prompt], incremental_state=state)[0]
        assert first.shape == (3, prompt, 40)
        steps = [first]
        for end in range(prompt + 1, tokens.size(1) + 1):
            step = model(tokens[:, :end], incremental_state=state)[0]
            assert step.shape == (3, 1, 40)  # only the new token is run
            steps.append(step)
        incremental = torch.cat(steps, dim=1)
    torch.testing.assert_close(incremental[real], full[real], atol=1e-5, rtol=1e-5)


def test_a_generation_fast_model_refuses_training():
    _, model, _, _ = build_pair("pre_ln_relu_tied")
    model.make_generation_fast_()
    assert not model.training
    model.eval()  # still allowed
    with pytest.raises(RuntimeError, match="cannot train after make_generation_fast_"):
        model.train()


def test_several_new_tokens_after_a_cache_are_causal():
    _, model, _, _ = build_pair("pre_ln_relu_tied")
    tokens = _tokens(left_pad=True)
    real = tokens.ne(PAD)
    with torch.no_grad():
        full = model(tokens)[0]
        state = {}
        head = model(tokens[:, :5], incremental_state=state)[0]
        tail = model(tokens, incremental_state=state)[0]  # 9 new tokens at once
    torch.testing.assert_close(torch.cat([head, tail], 1)[real], full[real], atol=1e-5, rtol=1e-5)


def test_reorder_incremental_state_selects_and_duplicates_rows():
    _, model, _, _ = build_pair("pre_ln_relu_tied")
    tokens = _tokens(left_pad=True)
    order = torch.tensor([2, 2, 0])
    with torch.no_grad():
        full = model(tokens[order])[0]
        state = {}
        model(tokens[:, :9], incremental_state=state)
        model.decoder.reorder_incremental_state(state, order)
        step = model(tokens[order, :10], incremental_state=state)[0]
    torch.testing.assert_close(step[:, -1], full[:, 9], atol=1e-5, rtol=1e-5)


def test_incremental_state_keys_are_private_to_each_instance():
    @with_incremental_state
    class Cache(nn.Module):
        pass

    a, b = Cache(), Cache()
    assert isinstance(a, IncrementalState)
    state = {}
    a.set_incremental_state(state, "kv", {"x": 1})
    assert a.get_incremental_state(state, "kv") == {"x": 1}
    assert b.get_incremental_state(state, "kv") is None
    assert a.get_incremental_state(None, "kv") is None


class BagOfTokensDecoder(BaseDecoder):
    """A user decoder in fairseq style: caches the tokens it has seen per row and predicts from
    their mean embedding. `use_cache=False` recomputes from `prev_output_tokens` instead, the
    reference that a wrong `reorder_incremental_state` would not match."""

    def __init__(self, dictionary, use_cache: bool):
        super().__init__(dictionary)
        self.use_cache = use_cache
        self.embed = nn.Embedding(len(dictionary), len(dictionary))
        nn.init.normal_(self.embed.weight, std=3.0, generator=torch.Generator().manual_seed(0))
        self.calls = []

    def extract_features(self, prev_output_tokens, incremental_state=None, **unused):
        seen = prev_output_tokens
        if self.use_cache and incremental_state is not None:
            saved = self.get_incremental_state(incremental_state, "seen")
            if saved is not None:
                seen = torch.cat([saved["tokens"], prev_output_tokens[:, saved["tokens"].size(1):]], dim=1)
            self.set_incremental_state(incremental_state, "seen", {"tokens": seen})
        self.calls.append(seen.size(0))
        weights = seen.ne(self.dictionary.pad()).float()[:, :, None]
        bag = (self.embed(seen) * weights).sum(1) / weights.sum(1)  # (B, V)
        return bag[:, None, :], None

    def output_layer(self, features, **kwargs):
        return features

    def reorder_incremental_state(self, incremental_state, new_order):
        saved = self.get_incremental_state(incremental_state, "seen")
        if saved is not None:
            self.set_incremental_state(incremental_state, "seen", {"tokens": saved["tokens"].index_select(0, new_order)})

    def max_positions(self):
        return 64


@pytest.mark.parametrize("beam_size", [1, 3])
def test_a_user_decoder_with_its_own_cache_plugs_into_the_generator(beam_size):
    prompts = [[5, 9, 11], [7], [12, 13]]
    outputs = []
    for use_cache in (True, False):
        decoder = BagOfTokensDecoder(TinyDictionary(), use_cache)
        generator = SequenceGenerator([decoder], TinyDictionary(), beam_size=beam_size, max_new_tokens=6, temperature=0)
        outputs.append([[h["tokens"].tolist() for h in row] for row in generator.generate([decoder], prompts)])
        if beam_size > 1:
            assert max(decoder.calls) == len(prompts) * beam_size  # beams were expanded by reordering
    assert outputs[0] == outputs[1]
    assert any(len(set(tokens)) > 1 for row in outputs[0] for tokens in row)


def test_inference_output_projection_follows_weight_updates():
    _, ours, _, _ = build_pair("pre_ln_relu_tied")
    decoder = ours.decoder
    features = torch.randn(2, 3, decoder.output_projection.weight.size(1))
    with torch.no_grad():
        first = decoder.output_layer(features)  # through the cached transposed copy
        torch.testing.assert_close(first, decoder.output_projection(features), rtol=1e-6, atol=1e-6)
        decoder.output_projection.weight.add_(0.5)  # what an optimizer step or a load does
        torch.testing.assert_close(decoder.output_layer(features), decoder.output_projection(features),
                                   rtol=1e-6, atol=1e-6)
    assert not torch.allclose(first, decoder.output_layer(features))
