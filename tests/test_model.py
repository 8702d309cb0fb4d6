"""The transformer_lm model and the --arch registries: sizes, plugins, and behaviour users rely on."""

import dataclasses
import math
from dataclasses import dataclass, field

import pytest
import torch

from metaseq_ds import models
from metaseq_ds.dataclass import MetaseqDataclass, validate_config
from metaseq_ds.errors import UsageError
from metaseq_ds.models import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_REGISTRY,
    MODEL_REGISTRY,
    BaseDecoder,
    IncrementalDecoder,
    LanguageModel,
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    arch_defaults,
    build_model,
    register_model,
    register_model_architecture,
)
from metaseq_ds.modules import Dropout
from test_hf_parity import PAD, TinyDictionary, TinyTask

def tiny_cfg(**changes):
    values = dict(
        decoder_embed_dim=16,
        decoder_ffn_embed_dim=32,
        decoder_layers=2,
        decoder_attention_heads=2,
        decoder_learned_pos=True,
        decoder_normalize_before=True,
        dropout=0.0,
        max_target_positions=16,
        init_std=0.2,
    )
    return TransformerLanguageModelConfig(**{**values, **changes})


def tiny_model(seed=0, **changes):
    torch.manual_seed(seed)
    return TransformerLanguageModel.build_model(tiny_cfg(**changes), TinyTask())


def tokens(batch=2, length=10, seed=1):
    return torch.randint(4, len(TinyDictionary()), (batch, length), generator=torch.Generator().manual_seed(seed))


def resolved(arch, **explicit):
    """The model config --arch gives, as the parser builds it (without building the model)."""
    values = arch_defaults(arch, explicit)
    fields = {f.name for f in dataclasses.fields(TransformerLanguageModelConfig)}
    return validate_config(TransformerLanguageModelConfig, {k: v for k, v in values.items() if k in fields})


# layers / d / heads from the OPT paper (ffn = 4d)
OPT_SIZES = {
    "opt_125m": (12, 768, 12),
    "opt_350m": (24, 1024, 16),
    "opt_1_3b": (24, 2048, 32),
    "opt_2_7b": (32, 2560, 32),
    "opt_6_7b": (32, 4096, 32),
    "opt_13b": (40, 5120, 40),
    "opt_30b": (48, 7168, 56),
    "opt_66b": (64, 9216, 72),
    "opt_175b": (96, 12288, 96),
}

# d / ffn / layers / heads from fairseq's transformer_lm.py and model-parallel transformer_lm_megatron
GPT_SIZES = {
    "transformer_lm_gpt": (768, 3072, 12, 12),
    "transformer_lm_gpt2_tiny": (64, 64, 2, 1),
    "transformer_lm_gpt2_small": (1024, 4096, 24, 16),
    "transformer_lm_gpt2_medium": (1280, 5120, 36, 20),
    "transformer_lm_gpt2_big": (1600, 6400, 48, 25),
    "transformer_lm_megatron": (3072, 12288, 72, 32),
}


@pytest.mark.parametrize("arch", sorted(OPT_SIZES))
def test_opt_architectures_have_the_paper_sizes(arch):
    cfg = resolved(arch)
    layers, dim, heads = OPT_SIZES[arch]
    assert (cfg.decoder_layers, cfg.decoder_embed_dim, cfg.decoder_attention_heads) == (layers, dim, heads)
    assert cfg.decoder_ffn_embed_dim == 4 * dim
    assert cfg.activation_fn == "relu" and cfg.dropout == 0.1
    assert cfg.decoder_learned_pos and cfg.share_decoder_input_output_embed and cfg.no_scale_embedding
    assert ARCH_MODEL_REGISTRY[arch] == "transformer_lm"
    if arch == "opt_350m":
        assert cfg.decoder_normalize_before is False and cfg.decoder_input_dim == 512
    else:
        assert cfg.decoder_normalize_before is True and cfg.decoder_input_dim is None


@pytest.mark.parametrize("arch", sorted(GPT_SIZES))
def test_fairseq_gpt_architectures(arch):
    cfg = resolved(arch)
    dim, ffn, layers, heads = GPT_SIZES[arch]
    assert (cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim, cfg.decoder_layers, cfg.decoder_attention_heads) == (
        dim,
        ffn,
        layers,
        heads,
    )
    assert cfg.activation_fn == "gelu" and cfg.attention_dropout == 0.1 and cfg.decoder_normalize_before


def test_every_builtin_arch_is_covered_and_the_model_name_is_an_arch():
    assert set(OPT_SIZES) | set(GPT_SIZES) | {"transformer_lm"} == {
        a for a, m in ARCH_MODEL_REGISTRY.items() if m == "transformer_lm"
    }
    assert resolved("transformer_lm") == TransformerLanguageModelConfig()


def test_explicit_values_beat_arch_defaults():
    cfg = resolved("opt_125m", decoder_layers=2, dropout=0.0)
    assert (cfg.decoder_layers, cfg.dropout, cfg.decoder_embed_dim) == (2, 0.0, 768)


def test_unknown_arch_is_a_usage_error_with_a_suggestion():
    with pytest.raises(UsageError, match=r"--arch: unknown architecture 'opt_125'; did you mean 'opt_125m'\?"):
        arch_defaults("opt_125", {})


def test_heads_must_divide_the_width():
    with pytest.raises(UsageError, match="--decoder-embed-dim 30 is not divisible by --decoder-attention-heads 4"):
        validate_config(TransformerLanguageModelConfig, {"decoder_embed_dim": 30, "decoder_attention_heads": 4})


def test_user_plugin_model_and_fairseq_style_architecture():
    @dataclass
    class ToyConfig(MetaseqDataclass):
        width: int = field(default=4, metadata={"help": "embedding width"})
        depth: int = field(default=1, metadata={"help": "ignored"})

    class ToyDecoder(BaseDecoder):
        def __init__(self, dictionary, width):
            super().__init__(dictionary)
            self.embed = torch.nn.Embedding(len(dictionary), width)
            self.out = torch.nn.Linear(width, len(dictionary))

        def extract_features(self, prev_output_tokens, **kwargs):
            return self.embed(prev_output_tokens), {}

        def output_layer(self, features, **kwargs):
            return self.out(features)

    try:

        @register_model("toy_plugin_lm", dataclass=ToyConfig)
        class ToyLM(LanguageModel):
            @classmethod
            def build_model(cls, cfg, task):
                return cls(ToyDecoder(task.dictionary, cfg.width))

        @register_model_architecture("toy_plugin_lm", "toy_plugin_lm_wide")
        def toy_wide(args):
            args.width = getattr(args, "width", 8)
            args.depth = getattr(args, "depth", 3)

        assert ARCH_MODEL_REGISTRY["toy_plugin_lm_wide"] == "toy_plugin_lm"
        assert arch_defaults("toy_plugin_lm_wide", {"depth": 5}) == {"width": 8, "depth": 5}
        assert arch_defaults("toy_plugin_lm", {}) == {}
        cfg = validate_config(ToyConfig, arch_defaults("toy_plugin_lm_wide", {}))
        model = build_model(cfg, TinyTask())
        assert isinstance(model, ToyLM) and model.decoder.embed.embedding_dim == 8
        logits, _ = model(tokens())
        assert logits.shape == (2, 10, len(TinyDictionary()))
        with pytest.raises(ValueError, match="duplicate"):
            register_model_architecture("toy_plugin_lm", "toy_plugin_lm_wide")(toy_wide)
        with pytest.raises(ValueError, match="unknown model"):
            register_model_architecture("no_such_model", "x")(toy_wide)
    finally:
        MODEL_REGISTRY.entries.pop("toy_plugin_lm", None)
        for arch in ("toy_plugin_lm", "toy_plugin_lm_wide"):
            ARCH_MODEL_REGISTRY.pop(arch, None)
            ARCH_CONFIG_REGISTRY.pop(arch, None)


def test_incremental_decoder_is_the_base_decoder():
    assert IncrementalDecoder is BaseDecoder
    assert models.TransformerLanguageModel is TransformerLanguageModel


def test_output_shapes_and_inner_states():
    model = tiny_model().eval()
    logits, extra = model(tokens(), src_lengths=torch.tensor([10, 10]))
    assert logits.shape == (2, 10, len(TinyDictionary()))
    assert len(extra["inner_states"]) == 3 and extra["inner_states"][0].shape == (2, 10, 16)
    features, _ = model(tokens(), features_only=True)
    assert features.shape == (2, 10, 16)
    probs = model.get_normalized_probs((logits, extra), log_probs=False)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 10))
    assert model.max_positions() == 16


def test_construction_is_deterministic_under_a_seed():
    a, b, c = tiny_model(seed=7).state_dict(), tiny_model(seed=7).state_dict(), tiny_model(seed=8).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["decoder.layers.0.fc1.weight"], c["decoder.layers.0.fc1.weight"])


def test_init_follows_opt():
    torch.manual_seed(0)
    cfg = tiny_cfg(decoder_embed_dim=64, decoder_ffn_embed_dim=256, decoder_layers=8, init_std=0.02)
    decoder = TransformerLanguageModel.build_model(cfg, TinyTask()).decoder
    layer = decoder.layers[0]
    assert layer.fc1.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert layer.fc2.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert layer.self_attn.out_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.1)
    assert torch.count_nonzero(layer.fc1.bias) == 0
    assert torch.equal(layer.final_layer_norm.weight, torch.ones(64))
    assert torch.count_nonzero(decoder.embed_tokens.weight[PAD]) == 0
    assert torch.count_nonzero(decoder.embed_positions.weight[PAD]) == 0


def test_tied_output_projection_is_the_token_embedding():
    tied = tiny_model(share_decoder_input_output_embed=True).decoder
    untied = tiny_model().decoder
    assert tied.output_projection.weight is tied.embed_tokens.weight
    assert untied.output_projection.weight is not untied.embed_tokens.weight


def test_embedding_scaling_multiplies_token_embeddings_by_sqrt_dim():
    common = dict(no_token_positional_embeddings=True)
    scaled, plain = tiny_model(**common).eval(), tiny_model(no_scale_embedding=True, **common).eval()
    scaled.load_state_dict(plain.state_dict())
    with torch.no_grad():
        scaled_embeddings = scaled(tokens())[1]["inner_states"][0]
        plain_embeddings = plain(tokens())[1]["inner_states"][0]
        torch.testing.assert_close(scaled_embeddings, plain_embeddings * math.sqrt(16))
        assert not torch.allclose(scaled(tokens())[0], plain(tokens())[0])


def test_dropout_only_in_training_mode():
    model = tiny_model(dropout=0.5, attention_dropout=0.5, activation_dropout=0.5)
    x = tokens()
    with torch.no_grad():
        model.eval()
        first, second = model(x)[0], model(x)[0]
        assert torch.equal(first, second)
        model.train()
        assert not torch.allclose(model(x)[0], first)

    dropout = Dropout(0.5).eval()
    ones = torch.ones(1000)
    assert torch.equal(dropout(ones), ones)
    dropout.apply_during_inference = True
    assert (dropout(ones) == 0).any()


@pytest.mark.parametrize("learned", [True, False])
def test_outputs_ignore_future_tokens(learned):
    model = tiny_model(decoder_learned_pos=learned).eval()
    x = tokens()
    changed = x.clone()
    changed[:, 6:] = (changed[:, 6:] + 5) % (len(TinyDictionary()) - 4) + 4
    with torch.no_grad():
        before, after = model(x)[0], model(changed)[0]
    torch.testing.assert_close(after[:, :6], before[:, :6])
    assert not torch.allclose(after[:, 6:], before[:, 6:])


@pytest.mark.parametrize("learned", [True, False])
def test_left_and_right_padding_leave_real_tokens_alone(learned):
    model = tiny_model(decoder_learned_pos=learned).eval()
    x = tokens(length=8)
    pads = torch.full((2, 3), PAD)
    with torch.no_grad():
        reference = model(x)[0]
        left = model(torch.cat([pads, x], dim=1))[0]
        right = model(torch.cat([x, pads], dim=1))[0]
    torch.testing.assert_close(left[:, 3:], reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(right[:, :8], reference, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(left).all()


def test_sinusoidal_positions_have_no_weights_and_no_positions_differ():
    sinusoidal = tiny_model(decoder_learned_pos=False)
    assert not any("embed_positions" in k for k in sinusoidal.state_dict())
    x = tokens()
    with torch.no_grad():
        none = tiny_model(no_token_positional_embeddings=True).eval()
        learned = tiny_model().eval()
        assert none.decoder.embed_positions is None
        assert not torch.allclose(none(x)[0], learned(x)[0])


def test_post_ln_has_no_final_norm_and_projects_in_and_out():
    decoder = tiny_model(decoder_normalize_before=False, decoder_input_dim=8).decoder
    assert decoder.final_layer_norm is None
    assert decoder.embed_tokens.embedding_dim == 8
    assert decoder.project_in.weight.shape == (16, 8) and decoder.project_out.weight.shape == (8, 16)
    assert decoder.embed_positions.weight.shape == (16 + 2, 16)  # OPT's offset 2


def test_length_limits_are_errors():
    with pytest.raises(ValueError, match="max_target_positions"):
        TransformerLanguageModel.build_model(tiny_cfg(max_target_positions=None), TinyTask())
    with pytest.raises(ValueError, match="17 tokens exceed max_target_positions 16"):
        tiny_model()(tokens(length=17))


def test_the_noted_left_padding_chooses_the_mask_the_tokens_would():
    """`note_left_padding` says on the CPU what the decoder would otherwise read from the device:
    the same logits with the note as without, for left-padded, right-padded and plain rows."""
    from metaseq_ds.models.transformer_decoder import note_left_padding

    model = tiny_model().eval()
    plain = tokens(batch=2, length=8)
    right, left = plain.clone(), plain.clone()
    right[1, 5:] = PAD
    left[1, :3] = PAD
    for batch, expected in ((plain, False), (right, False), (left, True)):
        sample = note_left_padding({"net_input": {"src_tokens": batch}}, model)
        assert sample["net_input"]["left_padded"] is expected
        torch.testing.assert_close(model(**sample["net_input"])[0], model(batch)[0], atol=0, rtol=0)
    other = {"net_input": {"src_tokens": plain}}
    assert note_left_padding(other, torch.nn.Linear(2, 2)) is other  # not our decoder: left as it is
