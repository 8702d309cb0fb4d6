"""Our transformer_lm computes what Hugging Face's OPTForCausalLM computes, via the production key map.

Tiny random models of each OPT variant; weights go ours -> HF with `hf_opt`, logits must match
in fp32, on a plain batch and on a left-padded one; then HF -> ours must give our logits back.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import OPTForCausalLM

from metaseq_ds.data import Dictionary
from metaseq_ds.models import TransformerLanguageModel, TransformerLanguageModelConfig
from metaseq_ds.models.hf_opt import key_map, state_dict_from_hf, state_dict_to_hf, to_hf_config
from metaseq_ds.models.transformer_decoder import embed_scale
from metaseq_ds.modules.cross_entropy import cross_entropy

PAD = 1


def TinyDictionary():
    return Dictionary.of_size(40)


class TinyTask:
    dictionary = TinyDictionary()


OPT_LIKE = dict(
    decoder_embed_dim=32,
    decoder_ffn_embed_dim=64,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_learned_pos=True,
    decoder_normalize_before=True,
    share_decoder_input_output_embed=True,
    no_scale_embedding=True,
    max_target_positions=16,
    init_std=0.2,  # large enough that every block visibly changes the logits
)

VARIANTS = {
    "pre_ln_relu_tied": {},
    "post_ln_projected_like_350m": {"decoder_normalize_before": False, "decoder_input_dim": 16},
    "gelu": {"activation_fn": "gelu"},
    "untied_output": {"share_decoder_input_output_embed": False},
    "untied_scaled_embeddings": {"share_decoder_input_output_embed": False, "no_scale_embedding": False},
    "no_final_norm": {"no_decoder_final_norm": True},
}


def build_pair(variant):
    cfg = TransformerLanguageModelConfig(**{**OPT_LIKE, **VARIANTS[variant]})
    torch.manual_seed(0)
    ours = TransformerLanguageModel.build_model(cfg, TinyTask()).eval()
    hf_config = to_hf_config(cfg, vocab_size=len(TinyDictionary()))
    hf_config._attn_implementation = "eager"
    hf = OPTForCausalLM(hf_config).eval()
    scale = embed_scale(cfg)
    hf.load_state_dict(state_dict_to_hf(ours.state_dict(), cfg.decoder_layers, embed_scale=scale), strict=True)
    return cfg, ours, hf, scale


def batches():
    generator = torch.Generator().manual_seed(1)
    plain = torch.randint(4, 40, (3, 12), generator=generator)
    left_padded = plain.clone()
    left_padded[0, :5] = PAD
    left_padded[1, :1] = PAD
    return plain, left_padded


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_hugging_face_opt(variant):
    cfg, ours, hf, _ = build_pair(variant)
    plain, left_padded = batches()
    with torch.no_grad():
        torch.testing.assert_close(ours(plain)[0], hf(plain).logits, atol=1e-5, rtol=1e-5)

        real = left_padded.ne(PAD)
        our_logits = ours(left_padded)[0]
        hf_logits = hf(left_padded, attention_mask=real.long()).logits
        torch.testing.assert_close(our_logits[real], hf_logits[real], atol=1e-5, rtol=1e-5)
        assert torch.isfinite(our_logits).all()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_match_hugging_face_opt(variant):
    """A training step's gradients (our criterion's cross entropy, our linear layers' oneDNN
    backward) equal HF's, parameter by parameter through the production key map. The models
    stay in eval mode only so that dropout is off."""
    cfg, ours, hf, scale = build_pair(variant)
    plain, _ = batches()
    source, target = plain[:, :-1], plain[:, 1:].reshape(-1)  # 33 rows: the oneDNN path (>= 32)
    vocab = len(TinyDictionary())
    cross_entropy(ours(source)[0].reshape(-1, vocab), target, ignore_index=PAD).sum().backward()
    F.cross_entropy(hf(source).logits.reshape(-1, vocab), target, ignore_index=PAD, reduction="sum").backward()
    hf_names = key_map(cfg.decoder_layers)
    for name, param in ours.named_parameters():
        expected = hf.get_parameter(hf_names[name]).grad
        if name == "decoder.embed_tokens.weight":
            expected = expected * scale  # HF's embedding is ours * scale
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padding_does_not_change_real_tokens(variant):
    _, ours, _, _ = build_pair(variant)
    plain, _ = batches()
    padded = torch.cat([torch.full((3, 4), PAD), plain], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(ours(padded)[0][:, 4:], ours(plain)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_hugging_face_weights_load_back(variant):
    cfg, ours, hf, scale = build_pair(variant)
    torch.manual_seed(123)  # other weights, so that a load that did nothing would fail
    again = TransformerLanguageModel.build_model(cfg, TinyTask()).eval()
    again.load_state_dict(
        state_dict_from_hf(hf.state_dict(), cfg.decoder_layers, embed_scale=scale), strict=True
    )
    plain, _ = batches()
    with torch.no_grad():
        torch.testing.assert_close(again(plain)[0], ours(plain)[0], atol=1e-5, rtol=1e-5)


def test_tied_checkpoint_without_lm_head_loads():
    cfg, ours, hf, _ = build_pair("pre_ln_relu_tied")
    hf_state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    again = TransformerLanguageModel.build_model(cfg, TinyTask()).eval()
    again.load_state_dict(state_dict_from_hf(hf_state, cfg.decoder_layers), strict=True)
    plain, _ = batches()
    with torch.no_grad():
        torch.testing.assert_close(again(plain)[0], ours(plain)[0])


def test_hf_config_fields():
    cfg = TransformerLanguageModelConfig(**{**OPT_LIKE, **VARIANTS["post_ln_projected_like_350m"]})
    hf_config = to_hf_config(cfg, vocab_size=40)
    assert (hf_config.hidden_size, hf_config.word_embed_proj_dim, hf_config.ffn_dim) == (32, 16, 64)
    assert hf_config.do_layer_norm_before is False
    assert hf_config.max_position_embeddings == 16
    assert (hf_config.pad_token_id, hf_config.bos_token_id, hf_config.eos_token_id) == (1, 2, 2)


@pytest.mark.parametrize(
    "change, complaint",
    [
        ({"decoder_learned_pos": False}, "sinusoidal"),
        ({"no_token_positional_embeddings": True}, "none"),
        ({"no_scale_embedding": False}, "scaled embeddings tied"),
    ],
)
def test_what_opt_cannot_express_is_refused(change, complaint):
    from metaseq_ds.errors import UsageError

    cfg = dataclasses.replace(TransformerLanguageModelConfig(**OPT_LIKE), **change)
    with pytest.raises(UsageError, match=complaint):
        to_hf_config(cfg, vocab_size=40)


def test_foreign_keys_are_refused():
    from metaseq_ds.errors import UsageError

    with pytest.raises(UsageError, match="decoder.layers.0.self_attn.qkv_proj.weight"):
        state_dict_to_hf({"decoder.layers.0.self_attn.qkv_proj.weight": torch.zeros(1)}, num_layers=1)
