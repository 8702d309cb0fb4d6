"""Our `transformer_lm` state dict <-> Hugging Face `OPTForCausalLM`, and the matching `OPTConfig`.

    hf_config = to_hf_config(cfg.model, vocab_size=len(dictionary))
    hf_model = OPTForCausalLM(hf_config)
    hf_model.load_state_dict(state_dict_to_hf(model.state_dict(), cfg.model.decoder_layers,
                                              embed_scale=embed_scale(cfg.model)))

The key map is one explicit table with `{}` standing for the layer index; the export and
import commands and the parity tests all use it.
"""

from typing import Dict, Mapping

import torch

from metaseq_ds.errors import UsageError

TOP_LEVEL_KEYS = {
    "decoder.embed_tokens.weight": "model.decoder.embed_tokens.weight",
    "decoder.embed_positions.weight": "model.decoder.embed_positions.weight",
    "decoder.project_in.weight": "model.decoder.project_in.weight",
    "decoder.project_out.weight": "model.decoder.project_out.weight",
    "decoder.final_layer_norm.weight": "model.decoder.final_layer_norm.weight",
    "decoder.final_layer_norm.bias": "model.decoder.final_layer_norm.bias",
    "decoder.output_projection.weight": "lm_head.weight",
}

LAYER_KEYS = {
    "decoder.layers.{}.self_attn.q_proj.weight": "model.decoder.layers.{}.self_attn.q_proj.weight",
    "decoder.layers.{}.self_attn.q_proj.bias": "model.decoder.layers.{}.self_attn.q_proj.bias",
    "decoder.layers.{}.self_attn.k_proj.weight": "model.decoder.layers.{}.self_attn.k_proj.weight",
    "decoder.layers.{}.self_attn.k_proj.bias": "model.decoder.layers.{}.self_attn.k_proj.bias",
    "decoder.layers.{}.self_attn.v_proj.weight": "model.decoder.layers.{}.self_attn.v_proj.weight",
    "decoder.layers.{}.self_attn.v_proj.bias": "model.decoder.layers.{}.self_attn.v_proj.bias",
    "decoder.layers.{}.self_attn.out_proj.weight": "model.decoder.layers.{}.self_attn.out_proj.weight",
    "decoder.layers.{}.self_attn.out_proj.bias": "model.decoder.layers.{}.self_attn.out_proj.bias",
    "decoder.layers.{}.self_attn_layer_norm.weight": "model.decoder.layers.{}.self_attn_layer_norm.weight",
    "decoder.layers.{}.self_attn_layer_norm.bias": "model.decoder.layers.{}.self_attn_layer_norm.bias",
    "decoder.layers.{}.fc1.weight": "model.decoder.layers.{}.fc1.weight",
    "decoder.layers.{}.fc1.bias": "model.decoder.layers.{}.fc1.bias",
    "decoder.layers.{}.fc2.weight": "model.decoder.layers.{}.fc2.weight",
    "decoder.layers.{}.fc2.bias": "model.decoder.layers.{}.fc2.bias",
    "decoder.layers.{}.final_layer_norm.weight": "model.decoder.layers.{}.final_layer_norm.weight",
    "decoder.layers.{}.final_layer_norm.bias": "model.decoder.layers.{}.final_layer_norm.bias",
}


def key_map(num_layers: int) -> Dict[str, str]:
    """Every possible key of ours -> its HF OPT key, for a model of `num_layers` layers."""
    keys = dict(TOP_LEVEL_KEYS)
    for layer in range(num_layers):
        keys.update({ours.format(layer): theirs.format(layer) for ours, theirs in LAYER_KEYS.items()})
    return keys


def to_hf_config(
    model_cfg, vocab_size: int, pad_token_id: int = 1, bos_token_id: int = 2, eos_token_id: int = 2
):
    """The `transformers.OPTConfig` of a `transformer_lm` config (`max_target_positions` set).

    The token ids default to those of the published OPT checkpoints, whose tokenizer starts
    every prompt with `</s>` (2) rather than `<s>`. Raises UsageError for what OPT cannot
    express: no learned positions, or scaled embeddings tied to the output.
    """
    from transformers import OPTConfig

    if model_cfg.no_token_positional_embeddings or not model_cfg.decoder_learned_pos:
        raise UsageError(
            "Hugging Face OPT needs learned position embeddings; this model was trained with "
            f"{'none' if model_cfg.no_token_positional_embeddings else 'sinusoidal ones'} (--decoder-learned-pos)"
        )
    if not model_cfg.no_scale_embedding and model_cfg.share_decoder_input_output_embed:
        raise UsageError(
            "Hugging Face OPT has no embedding scaling, and scaled embeddings tied to the output "
            "cannot be folded into the weights (train with --no-scale-embedding, as OPT)"
        )
    embed_dim = model_cfg.decoder_embed_dim
    return OPTConfig(
        vocab_size=vocab_size,
        hidden_size=embed_dim,
        num_hidden_layers=model_cfg.decoder_layers,
        ffn_dim=model_cfg.decoder_ffn_embed_dim,
        num_attention_heads=model_cfg.decoder_attention_heads,
        max_position_embeddings=model_cfg.max_target_positions,
        do_layer_norm_before=model_cfg.decoder_normalize_before,
        _remove_final_layer_norm=model_cfg.no_decoder_final_norm,
        word_embed_proj_dim=model_cfg.decoder_input_dim or embed_dim,
        activation_function=model_cfg.activation_fn,
        dropout=model_cfg.dropout,
        attention_dropout=model_cfg.attention_dropout,
        enable_bias=True,
        layer_norm_elementwise_affine=True,
        tie_word_embeddings=model_cfg.share_decoder_input_output_embed,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


def state_dict_to_hf(
    state_dict: Mapping[str, torch.Tensor], num_layers: int, embed_scale: float = 1.0
) -> Dict[str, torch.Tensor]:
    """Our state dict -> `OPTForCausalLM`'s.

    `embed_scale` (see `transformer_decoder.embed_scale`) is folded into an untied token
    embedding, since OPT has no scaling of its own.
    """
    keys = key_map(num_layers)
    unknown = sorted(set(state_dict) - set(keys))
    if unknown:
        raise UsageError(f"state dict key {unknown[0]!r} has no Hugging Face OPT equivalent (is it a transformer_lm?)")
    hf = {keys[name]: tensor for name, tensor in state_dict.items()}
    if embed_scale != 1.0:
        hf["model.decoder.embed_tokens.weight"] = hf["model.decoder.embed_tokens.weight"] * embed_scale
    return hf


def state_dict_from_hf(
    hf_state_dict: Mapping[str, torch.Tensor], num_layers: int, embed_scale: float = 1.0
) -> Dict[str, torch.Tensor]:
    """`OPTForCausalLM`'s state dict -> ours; the inverse of `state_dict_to_hf`.

    A tied HF checkpoint may omit `lm_head.weight`; the output projection then is the
    token embedding, as it is in a tied model of ours.
    """
    ours_of = {theirs: ours for ours, theirs in key_map(num_layers).items()}
    unknown = sorted(set(hf_state_dict) - set(ours_of))
    if unknown:
        raise UsageError(f"Hugging Face key {unknown[0]!r} is not part of an OPT model of {num_layers} layers")
    state_dict = {ours_of[name]: tensor for name, tensor in hf_state_dict.items()}
    state_dict.setdefault("decoder.output_projection.weight", state_dict["decoder.embed_tokens.weight"])
    if embed_scale != 1.0:
        state_dict["decoder.embed_tokens.weight"] = state_dict["decoder.embed_tokens.weight"] / embed_scale
    return state_dict
