"""`mseq import hf HF_DIR OUT` and `mseq train --restore-file hf:HF_DIR`: a Hugging Face OPT folder -> ours.

    mseq import hf facebook-opt-125m/ ckpt/opt125m
    mseq validate --path ckpt/opt125m --data DATA

HF_DIR holds `config.json` (model_type "opt") and weights as `model.safetensors`, sharded
safetensors with an index, or `pytorch_model.bin` (+ index). Files saved from `OPTModel`, as
the hub's OPT checkpoints were, lack the `model.` prefix and `lm_head`: both layouts load.
Tokenizer files (`tokenizer.json`, or `vocab.json` + `merges.txt`) are copied along.
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

from metaseq_ds.checkpoint.safetensors_io import read_weight_file
from metaseq_ds.errors import UsageError


def import_hf(hf_dir: str, out: str) -> List[str]:
    from metaseq_ds.convert.weights_checkpoint import write_weights_only_checkpoint

    folder = Path(hf_dir)
    model_fields, state_dict = read_hf_model(folder)
    return write_weights_only_checkpoint(Path(out), state_dict, model_fields, tokenizer_files(folder), f"HF_DIR {folder}")


def read_hf_model(folder: Path) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Our model fields and our state dict for an OPT folder; safetensors weights are read lazily
    (each `.contiguous()` reads one tensor from the file), `.bin` files are memory-mapped."""
    from metaseq_ds.models.hf_opt import state_dict_from_hf

    hf_config = read_hf_config(folder)
    fields = model_fields_from_hf(hf_config, f"HF_DIR {folder}")
    hf_state = {("model." + k if k.startswith("decoder.") else k): v for k, v in read_hf_weights(folder).items()}
    try:
        state_dict = state_dict_from_hf(hf_state, fields["decoder_layers"])
    except UsageError as error:
        raise UsageError(f"HF_DIR {folder}: {error}") from None
    return fields, state_dict


def read_hf_config(folder: Path):
    from transformers import OPTConfig

    path = folder / "config.json"
    if not path.is_file():
        raise UsageError(f"HF_DIR {folder} is not a Hugging Face model folder (no config.json)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as error:
        raise UsageError(f"{path}: not valid JSON ({error})") from None
    if raw.get("model_type") != "opt":
        raise UsageError(f"HF_DIR {folder} holds a {raw.get('model_type')!r} model; only OPT (model_type 'opt') imports")
    return OPTConfig.from_dict(raw)


def model_fields_from_hf(hf_config, source: str) -> Dict[str, Any]:
    """The `transformer_lm` fields of an `OPTConfig`; what our model cannot compute is refused."""
    from metaseq_ds.convert.weights_checkpoint import model_fields_or_error

    if hf_config.activation_function not in ("relu", "gelu"):
        raise UsageError(f"{source}: activation_function {hf_config.activation_function!r} is not supported (relu, gelu)")
    if not (hf_config.enable_bias and hf_config.layer_norm_elementwise_affine):
        raise UsageError(f"{source}: OPT without biases or LayerNorm affine parameters is not supported")
    if hf_config.pad_token_id != 1:
        raise UsageError(f"{source}: pad_token_id {hf_config.pad_token_id}; our models (as OPT) pad with id 1")
    hidden = hf_config.hidden_size
    return model_fields_or_error({
        "decoder_embed_dim": hidden,
        "decoder_input_dim": hf_config.word_embed_proj_dim if hf_config.word_embed_proj_dim != hidden else None,
        "decoder_ffn_embed_dim": hf_config.ffn_dim,
        "decoder_layers": hf_config.num_hidden_layers,
        "decoder_attention_heads": hf_config.num_attention_heads,
        "decoder_normalize_before": hf_config.do_layer_norm_before,
        "no_decoder_final_norm": hf_config._remove_final_layer_norm and hf_config.do_layer_norm_before,
        "activation_fn": hf_config.activation_function,
        "dropout": hf_config.dropout,
        "attention_dropout": hf_config.attention_dropout,
        "share_decoder_input_output_embed": hf_config.tie_word_embeddings,
        "decoder_learned_pos": True,
        "no_scale_embedding": True,
        "max_target_positions": hf_config.max_position_embeddings,
    }, source)


def read_hf_weights(folder: Path) -> Dict[str, Any]:
    """All tensors of the folder's weight files (safetensors preferred, then pytorch_model.bin),
    each read when it is used (see `read_hf_model`)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (folder / index).is_file():
            try:
                files = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError) as error:
                raise UsageError(f"{folder / index}: not a weight index ({error})") from None
            break
        if (folder / single).is_file():
            files = [single]
            break
    else:
        raise UsageError(f"HF_DIR {folder} has no weights (model.safetensors or pytorch_model.bin, or their index)")
    weights: Dict[str, Any] = {}
    for name in files:
        weights.update(read_weight_file(folder / name))
    return weights


def tokenizer_files(folder: Path) -> Dict[str, Path]:
    """`--hf-tokenizer` or `--vocab-filename`/`--merges-filename` files found in the folder."""
    if (folder / "tokenizer.json").is_file():
        return {"hf_tokenizer": folder / "tokenizer.json"}
    if (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        return {"vocab_filename": folder / "vocab.json", "merges_filename": folder / "merges.txt"}
    return {}
