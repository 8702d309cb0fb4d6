"""`transformer_lm`: the decoder-only language model of fairseq and metaseq, and its `--arch`es.

The architectures are tables of config defaults: fairseq's `transformer_lm_gpt*` family,
`transformer_lm_megatron`, and the OPT sizes `opt_125m` ... `opt_175b` (pre-LN except
350m, ReLU, learned positions, tied embeddings, no embedding scaling, FFN 4d).
"""

from dataclasses import dataclass, field
from typing import Literal, Optional

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import DropoutProbability, PositiveFloat, PositiveInt
from metaseq_ds.models.registry import register_architecture_defaults, register_model
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


def _fairseq_gpt(embed_dim: int, ffn_dim: int, layers: int, heads: int) -> dict:
    # fairseq's GPT family, except learned positions (fairseq: sinusoids) so that every
    # built-in arch exports to Hugging Face OPT; pass decoder_learned_pos: false in a config
    # file for fairseq's original.
    return {
        "decoder_embed_dim": embed_dim,
        "decoder_ffn_embed_dim": ffn_dim,
        "decoder_layers": layers,
        "decoder_attention_heads": heads,
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_fn": "gelu",
        "decoder_normalize_before": True,
        "decoder_learned_pos": True,
    }


def _opt(layers: int, embed_dim: int, heads: int) -> dict:
    return {
        "decoder_embed_dim": embed_dim,
        "decoder_ffn_embed_dim": 4 * embed_dim,
        "decoder_layers": layers,
        "decoder_attention_heads": heads,
        "activation_fn": "relu",
        "dropout": 0.1,
        "attention_dropout": 0.0,
        "decoder_normalize_before": True,
        "decoder_learned_pos": True,
        "share_decoder_input_output_embed": True,
        "no_scale_embedding": True,
    }


ARCHITECTURES = {
    "transformer_lm_gpt": _fairseq_gpt(768, 3072, 12, 12),
    "transformer_lm_gpt2_tiny": _fairseq_gpt(64, 64, 2, 1),
    "transformer_lm_gpt2_small": _fairseq_gpt(1024, 4096, 24, 16),
    "transformer_lm_gpt2_medium": _fairseq_gpt(1280, 5120, 36, 20),
    "transformer_lm_gpt2_big": _fairseq_gpt(1600, 6400, 48, 25),
    "transformer_lm_megatron": _fairseq_gpt(3072, 12288, 72, 32),
    "opt_125m": _opt(12, 768, 12),
    "opt_350m": {**_opt(24, 1024, 16), "decoder_normalize_before": False, "decoder_input_dim": 512},
    "opt_1_3b": _opt(24, 2048, 32),
    "opt_2_7b": _opt(32, 2560, 32),
    "opt_6_7b": _opt(32, 4096, 32),
    "opt_13b": _opt(40, 5120, 40),
    "opt_30b": _opt(48, 7168, 56),
    "opt_66b": _opt(64, 9216, 72),
    "opt_175b": _opt(96, 12288, 96),
}

for _arch, _defaults in ARCHITECTURES.items():
    register_architecture_defaults("transformer_lm", _arch, _defaults)
