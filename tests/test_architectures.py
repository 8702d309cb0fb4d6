"""The `--arch` functions of transformer_lm: the values each built-in one resolves to, and the
fairseq-style plugin architectures that import them and chain on them."""

import dataclasses
import types
from dataclasses import dataclass, field

import pytest
import torch

from metaseq_ds.data import Dictionary
from metaseq_ds.errors import UsageError
from metaseq_ds.models import (
    ARCH_CONFIG_REGISTRY,
    ARCH_MODEL_REGISTRY,
    MODEL_REGISTRY,
    TransformerLanguageModel,
    TransformerLanguageModelConfig,
    build_model,
    register_model,
    register_model_architecture,
)
from metaseq_ds.models import transformer_lm
from metaseq_ds.models.transformer_lm import base_lm_architecture, opt_125m, transformer_lm_gpt2_tiny
from metaseq_ds.options import parse_train_config

DATA = ["/some/data"]

# What `parse_train_config(DATA + ["--arch", arch]).model` held at 2c9fa3e, when the presets
# were tables of defaults; the functions that replaced them must resolve to the same.
DATACLASS_DEFAULTS = dict(
    activation_fn="relu", dropout=0.1, attention_dropout=0.0, activation_dropout=0.0, decoder_input_dim=None,
    decoder_normalize_before=False, no_decoder_final_norm=False, share_decoder_input_output_embed=False,
    decoder_learned_pos=False, no_token_positional_embeddings=False, no_scale_embedding=False,
    max_target_positions=1024, init_std=0.006,
)
GPT = {**DATACLASS_DEFAULTS, "activation_fn": "gelu", "attention_dropout": 0.1, "decoder_normalize_before": True,
       "decoder_learned_pos": True}
OPT = {**DATACLASS_DEFAULTS, "decoder_normalize_before": True, "decoder_learned_pos": True,
       "share_decoder_input_output_embed": True, "no_scale_embedding": True}


def sizes(embed_dim, ffn_dim, layers, heads):
    return dict(decoder_embed_dim=embed_dim, decoder_ffn_embed_dim=ffn_dim, decoder_layers=layers,
                decoder_attention_heads=heads)


PINNED = {
    "transformer_lm": {**DATACLASS_DEFAULTS, **sizes(512, 2048, 6, 8)},
    "transformer_lm_gpt": {**GPT, **sizes(768, 3072, 12, 12)},
    "transformer_lm_gpt2_tiny": {**GPT, **sizes(64, 64, 2, 1)},
    "transformer_lm_gpt2_small": {**GPT, **sizes(1024, 4096, 24, 16)},
    "transformer_lm_gpt2_medium": {**GPT, **sizes(1280, 5120, 36, 20)},
    "transformer_lm_gpt2_big": {**GPT, **sizes(1600, 6400, 48, 25)},
    "transformer_lm_megatron": {**GPT, **sizes(3072, 12288, 72, 32)},
    "opt_125m": {**OPT, **sizes(768, 3072, 12, 12)},
    "opt_350m": {**OPT, **sizes(1024, 4096, 24, 16), "decoder_normalize_before": False, "decoder_input_dim": 512},
    "opt_1_3b": {**OPT, **sizes(2048, 8192, 24, 32)},
    "opt_2_7b": {**OPT, **sizes(2560, 10240, 32, 32)},
    "opt_6_7b": {**OPT, **sizes(4096, 16384, 32, 32)},
    "opt_13b": {**OPT, **sizes(5120, 20480, 40, 40)},
    "opt_30b": {**OPT, **sizes(7168, 28672, 48, 56)},
    "opt_66b": {**OPT, **sizes(9216, 36864, 64, 72)},
    "opt_175b": {**OPT, **sizes(12288, 49152, 96, 96)},
}


def model_values(argv):
    return dataclasses.asdict(parse_train_config(DATA + argv).model)


def test_every_builtin_arch_is_pinned():
    assert set(PINNED) == {arch for arch, model in ARCH_MODEL_REGISTRY.items() if model == "transformer_lm"}


@pytest.mark.parametrize("arch", sorted(PINNED))
def test_builtin_arch_resolves_to_its_pinned_values(arch):
    assert model_values(["--arch", arch]) == PINNED[arch]


@pytest.mark.parametrize("arch", sorted(set(PINNED) - {"transformer_lm"}))
def test_builtin_arch_is_the_public_function_of_its_name(arch):
    assert getattr(transformer_lm, arch) is ARCH_CONFIG_REGISTRY[arch]


def test_base_lm_architecture_fills_only_what_is_not_set():
    args = types.SimpleNamespace(decoder_layers=3)
    base_lm_architecture(args)
    assert vars(args) == {**dataclasses.asdict(TransformerLanguageModelConfig()), "decoder_layers": 3}


def test_fairseqs_positive_final_norm_attribute_is_understood():
    args = types.SimpleNamespace(decoder_final_norm=False)
    base_lm_architecture(args)
    assert args.no_decoder_final_norm is True


@pytest.fixture
def registered():
    """Registers through the global registries under this test's names; removes them after."""
    models, archs = [], []

    def model(name, dataclass):
        models.append(name)
        archs.append(name)
        return register_model(name, dataclass=dataclass)

    def architecture(model_name, arch_name):
        archs.append(arch_name)
        return register_model_architecture(model_name, arch_name)

    yield types.SimpleNamespace(model=model, architecture=architecture)
    for name in models:
        MODEL_REGISTRY.entries.pop(name, None)
    for name in archs:
        ARCH_MODEL_REGISTRY.pop(name, None)
        ARCH_CONFIG_REGISTRY.pop(name, None)


def test_plugin_arch_calling_base_last_sets_defaults_flags_override(registered):
    @registered.architecture("transformer_lm", "test_arch_base_last")
    def base_last(args):
        args.decoder_layers = getattr(args, "decoder_layers", 3)
        args.adaptive_input = getattr(args, "adaptive_input", False)  # fairseq's; no field here: ignored
        base_lm_architecture(args)

    values = model_values(["--arch", "test_arch_base_last"])
    assert values == {**PINNED["transformer_lm"], "decoder_layers": 3}
    assert model_values(["--arch", "test_arch_base_last", "--decoder-layers", "5"])["decoder_layers"] == 5
    with pytest.raises(UsageError, match="unknown flag --adaptive-input"):
        parse_train_config(DATA + ["--arch", "test_arch_base_last", "--adaptive-input"])


def test_plugin_arch_calling_base_first_reads_what_it_filled(registered):
    @registered.architecture("transformer_lm", "test_arch_base_first")
    def base_first(args):
        base_lm_architecture(args)
        args.decoder_layers = getattr(args, "decoder_layers", 3)  # base set it already: fairseq's order rule
        args.decoder_ffn_embed_dim = 3 * args.decoder_embed_dim

    values = model_values(["--arch", "test_arch_base_first"])
    assert (values["decoder_layers"], values["decoder_ffn_embed_dim"]) == (6, 1536)
    assert model_values(["--arch", "test_arch_base_first", "--decoder-layers", "5"])["decoder_layers"] == 5


def test_plugin_arch_computes_with_command_line_values(registered):
    @registered.architecture("transformer_lm", "test_arch_wide_ffn")
    def wide_ffn(args):
        args.decoder_ffn_embed_dim = 3 * getattr(args, "decoder_embed_dim", 512)
        base_lm_architecture(args)

    assert model_values(["--arch", "test_arch_wide_ffn", "--decoder-embed-dim", "64"])["decoder_ffn_embed_dim"] == 192


def test_plugin_arch_chaining_on_a_preset(registered):
    @registered.architecture("transformer_lm", "test_arch_shallow_opt")
    def shallow_opt(args):
        args.decoder_layers = getattr(args, "decoder_layers", 2)
        opt_125m(args)

    assert model_values(["--arch", "test_arch_shallow_opt"]) == {**PINNED["opt_125m"], "decoder_layers": 2}


def test_plugin_arch_on_its_own_model_subclass(registered):
    @dataclass
    class GatedLMConfig(TransformerLanguageModelConfig):
        gate_init: float = field(default=1.0, metadata={"help": "initial value of the output gate"})

    @registered.model("test_gated_lm", GatedLMConfig)
    class GatedLM(TransformerLanguageModel):
        pass

    @registered.architecture("test_gated_lm", "test_gated_lm_tiny")
    def gated_tiny(args):
        args.gate_init = getattr(args, "gate_init", 0.5)
        args.decoder_layers = getattr(args, "decoder_layers", 1)
        transformer_lm_gpt2_tiny(args)

    cfg = parse_train_config(DATA + ["--arch", "test_gated_lm_tiny", "--decoder-embed-dim", "32",
                                     "--tokens-per-sample", "16"]).model
    assert isinstance(cfg, GatedLMConfig) and cfg._name == "test_gated_lm"
    assert (cfg.gate_init, cfg.decoder_layers, cfg.decoder_embed_dim, cfg.activation_fn) == (0.5, 1, 32, "gelu")
    model = build_model(cfg, types.SimpleNamespace(dictionary=Dictionary()))
    assert isinstance(model, GatedLM)
    logits, _ = model(torch.tensor([[0, 3, 2]]))
    assert logits.shape[:2] == (1, 3)
