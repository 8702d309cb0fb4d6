"""`transformer_lm`: the decoder-only language model of fairseq and metaseq, and its `--arch`es.

The architectures are fairseq-style functions of an `args` namespace, importable by plugins:
`base_lm_architecture` (the config's own defaults), fairseq's `transformer_lm_gpt*` family,
`transformer_lm_megatron`, and the OPT sizes `opt_125m` ... `opt_175b` (pre-LN except 350m,
ReLU, learned positions, tied embeddings, no embedding scaling, FFN 4d). A plugin chains on them:

    @register_model_architecture("transformer_lm", "my_lm")
    def my_lm(args):
        args.decoder_layers = getattr(args, "decoder_layers", 3)
        base_lm_architecture(args)
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import DropoutProbability, PositiveFloat, PositiveInt
from metaseq_ds.models.registry import register_model, register_model_architecture
from metaseq_ds.models.base import LanguageModel
from metaseq_ds.models.initialization import initialization_seed, initialize_parameters
from metaseq_ds.models.transformer_decoder import TransformerDecoder


@dataclass
class TransformerLanguageModelConfig(MetaseqDataclass):
    activation_fn: Literal["relu", "gelu"] = field(default="relu", metadata={"help": "activation function of the FFN"})
    dropout: DropoutProbability = field(default=0.1, metadata={"help": "dropout probability on embeddings and block outputs"})
    attention_dropout: DropoutProbability = field(default=0.0, metadata={"help": "dropout probability on attention weights"})
    activation_dropout: DropoutProbability = field(default=0.0, metadata={"help": "dropout probability after the FFN activation"})
    decoder_embed_dim: PositiveInt = field(default=512, metadata={"help": "model width (hidden size)"})
    decoder_input_dim: Optional[PositiveInt] = field(
        default=None,
        metadata={"help": "width of the token embeddings (default: --decoder-embed-dim); another value adds project_in/project_out, as OPT-350m's 512"},
    )
    decoder_ffn_embed_dim: PositiveInt = field(default=2048, metadata={"help": "inner width of the FFN"})
    decoder_layers: PositiveInt = field(default=6, metadata={"help": "number of decoder layers"})
    decoder_attention_heads: PositiveInt = field(default=8, metadata={"help": "number of attention heads"})
    decoder_normalize_before: bool = field(
        default=False, metadata={"help": "LayerNorm before each block (pre-LN); the gpt and OPT archs set it, except opt_350m"}
    )
    no_decoder_final_norm: bool = field(default=False, metadata={"help": "no LayerNorm after the last pre-LN layer"})
    share_decoder_input_output_embed: bool = field(
        default=False, metadata={"help": "tie the output projection to the token embeddings"}
    )
    decoder_learned_pos: bool = field(
        default=False, metadata={"help": "learned position embeddings (OPT; needed for Hugging Face export) instead of sinusoids"}
    )
    no_token_positional_embeddings: bool = field(
        default=False, metadata={"help": "no position embeddings at all (order comes from the causal mask only)"}
    )
    no_scale_embedding: bool = field(
        default=False, metadata={"help": "do not multiply token embeddings by sqrt(--decoder-embed-dim) (OPT)"}
    )
    max_target_positions: Optional[PositiveInt] = field(
        default=None, metadata={"help": "longest sequence the model accepts (default: --tokens-per-sample)"}
    )
    init_std: PositiveFloat = field(
        default=0.006,
        metadata={"help": "std of the normal weight init (OPT's 0.006; out_proj/fc2 get it / sqrt(2 * layers))"},
    )

    def __post_init__(self):
        if self.decoder_embed_dim % self.decoder_attention_heads != 0:
            raise ValueError(
                f"--decoder-embed-dim {self.decoder_embed_dim} is not divisible by "
                f"--decoder-attention-heads {self.decoder_attention_heads}"
            )


@register_model("transformer_lm", dataclass=TransformerLanguageModelConfig)
class TransformerLanguageModel(LanguageModel):
    """A `TransformerDecoder` over the task's dictionary, predicting the next token."""

    @classmethod
    def build_model(cls, cfg: TransformerLanguageModelConfig, task) -> "TransformerLanguageModel":
        """Construct and initialise (`reset_parameter`); the torch seed decides the weights. Under
        `torch.device("meta")` nothing is allocated or drawn (see `distributed.materialize`)."""
        seed = initialization_seed()
        model = cls(TransformerDecoder(cfg, task.dictionary))
        initialize_parameters(model, seed)
        return model

    def reset_parameter(self, name: str, value, generator) -> None:
        self.decoder.reset_parameter(name.removeprefix("decoder."), value, generator)


def base_lm_architecture(args) -> None:
    """The defaults every transformer_lm architecture ends on, fairseq's and metaseq's function of
    the same name: each field of `TransformerLanguageModelConfig` that `args` does not hold yet
    gets its dataclass default (the one source of those values). Attributes set already win, so
    an architecture may call it last, as the presets below do, or first, as some plugins do.

    Differences from fairseq's: pre-LN is not forced (`--arch transformer_lm` and opt_350m are
    post-LN; the gpt presets set it); `decoder_input_dim` stays None, meaning "the embedding
    width"; not set are the attributes of features metaseq_ds does not have (adaptive input and
    softmax, character embeddings, decoder_output_dim, quant-noise, layerdrop, BASE layers,
    NormFormer's scale_*, layernorm_embedding, add_bos_token) and activation checkpointing (a
    distributed-training flag with its own default).
    """
    # A fairseq plugin may still name the final LayerNorm by fairseq's older positive flag.
    if hasattr(args, "decoder_final_norm") and not hasattr(args, "no_decoder_final_norm"):
        args.no_decoder_final_norm = not args.decoder_final_norm
    for f in dataclasses.fields(TransformerLanguageModelConfig):
        if not hasattr(args, f.name):
            setattr(args, f.name, f.default)


def _set_defaults(args, **defaults) -> None:
    """fairseq's `args.x = getattr(args, "x", default)` for each keyword: values set already win."""
    for name, value in defaults.items():
        setattr(args, name, getattr(args, name, value))


def _fairseq_gpt(args, embed_dim: int, ffn_dim: int, layers: int, heads: int) -> None:
    _set_defaults(
        args,
        decoder_embed_dim=embed_dim,
        decoder_ffn_embed_dim=ffn_dim,
        decoder_layers=layers,
        decoder_attention_heads=heads,
        dropout=0.1,
        attention_dropout=0.1,
        activation_fn="gelu",
        # fairseq's base_lm_architecture forces pre-LN for every arch; here the arch sets it.
        decoder_normalize_before=True,
        # fairseq's GPT family, except learned positions (fairseq: sinusoids) so that every
        # built-in arch exports to Hugging Face OPT; pass decoder_learned_pos: false in a config
        # file for fairseq's original.
        decoder_learned_pos=True,
    )
    base_lm_architecture(args)


@register_model_architecture("transformer_lm", "transformer_lm_gpt")
def transformer_lm_gpt(args) -> None:
    _fairseq_gpt(args, embed_dim=768, ffn_dim=3072, layers=12, heads=12)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_tiny")
def transformer_lm_gpt2_tiny(args) -> None:
    _fairseq_gpt(args, embed_dim=64, ffn_dim=64, layers=2, heads=1)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_small")
def transformer_lm_gpt2_small(args) -> None:
    _fairseq_gpt(args, embed_dim=1024, ffn_dim=4096, layers=24, heads=16)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_medium")
def transformer_lm_gpt2_medium(args) -> None:
    _fairseq_gpt(args, embed_dim=1280, ffn_dim=5120, layers=36, heads=20)


@register_model_architecture("transformer_lm", "transformer_lm_gpt2_big")
def transformer_lm_gpt2_big(args) -> None:
    _fairseq_gpt(args, embed_dim=1600, ffn_dim=6400, layers=48, heads=25)


@register_model_architecture("transformer_lm", "transformer_lm_megatron")
def transformer_lm_megatron(args) -> None:
    """fairseq's and metaseq's model-parallel preset, here on the one transformer_lm."""
    _fairseq_gpt(args, embed_dim=3072, ffn_dim=12288, layers=72, heads=32)


def _opt(args, layers: int, embed_dim: int, heads: int) -> None:
    _set_defaults(
        args,
        decoder_embed_dim=embed_dim,
        # 4x the preset's width, not an explicitly given one: --decoder-embed-dim alone keeps the FFN
        decoder_ffn_embed_dim=4 * embed_dim,
        decoder_layers=layers,
        decoder_attention_heads=heads,
        activation_fn="relu",
        dropout=0.1,
        attention_dropout=0.0,
        decoder_normalize_before=True,
        decoder_learned_pos=True,
        share_decoder_input_output_embed=True,
        no_scale_embedding=True,
    )
    base_lm_architecture(args)


@register_model_architecture("transformer_lm", "opt_125m")
def opt_125m(args) -> None:
    _opt(args, layers=12, embed_dim=768, heads=12)


@register_model_architecture("transformer_lm", "opt_350m")
def opt_350m(args) -> None:
    # The one post-LN OPT, with 512-wide embeddings projected in and out (HF's project_in/out).
    _set_defaults(args, decoder_normalize_before=False, decoder_input_dim=512)
    _opt(args, layers=24, embed_dim=1024, heads=16)


@register_model_architecture("transformer_lm", "opt_1_3b")
def opt_1_3b(args) -> None:
    _opt(args, layers=24, embed_dim=2048, heads=32)


@register_model_architecture("transformer_lm", "opt_2_7b")
def opt_2_7b(args) -> None:
    _opt(args, layers=32, embed_dim=2560, heads=32)


@register_model_architecture("transformer_lm", "opt_6_7b")
def opt_6_7b(args) -> None:
    _opt(args, layers=32, embed_dim=4096, heads=32)


@register_model_architecture("transformer_lm", "opt_13b")
def opt_13b(args) -> None:
    _opt(args, layers=40, embed_dim=5120, heads=40)


@register_model_architecture("transformer_lm", "opt_30b")
def opt_30b(args) -> None:
    _opt(args, layers=48, embed_dim=7168, heads=56)


@register_model_architecture("transformer_lm", "opt_66b")
def opt_66b(args) -> None:
    _opt(args, layers=64, embed_dim=9216, heads=72)


@register_model_architecture("transformer_lm", "opt_175b")
def opt_175b(args) -> None:
    _opt(args, layers=96, embed_dim=12288, heads=96)
