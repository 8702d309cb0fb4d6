"""`mseq import metaseq CKPT OUT`: a metaseq or fairseq `transformer_lm` checkpoint -> ours.

    mseq import metaseq opt/checkpoint_last.pt ckpt/imported
    mseq import metaseq opt/reshard-model_part-0.pt ckpt/imported   # finds parts 1, 2, ... beside it
    mseq import metaseq fairseq_lm/checkpoint_best.pt ckpt/lm --vocab-filename ... --merges-filename ...

Accepted: a singleton `.pt` (split q/k/v or fused `qkv_proj`), model-parallel parts
`PREFIX-model_part-{r}.pt` (merged by the split dimensions of our tensor-parallel plan, `key_maps.partition_dim`; fused qkv rows are K, V, Q
within each part), and fairseq checkpoints of `transformer_lm` / `transformer_lm_gpt*`.
Files load with `weights_only=True` when torch allows; otherwise the restricted unpickler reads
them without importing fairseq, metaseq or omegaconf, and the command says which classes
it stood in for. Not accepted: FSDP-flattened `-shard{N}.pt` files (consolidate them with
metaseq's tools first), adaptive input/softmax models.
"""

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from metaseq_ds.errors import UsageError

PART_MARK = "-model_part-"


def import_metaseq(checkpoint: str, out: str, hf_tokenizer: Optional[str] = None,
                   vocab_filename: Optional[str] = None, merges_filename: Optional[str] = None) -> List[str]:
    from metaseq_ds.convert.restricted_unpickler import load_legacy_checkpoint
    from metaseq_ds.convert.weights_checkpoint import write_weights_only_checkpoint

    path = Path(checkpoint)
    if not path.is_file():
        raise UsageError(f"CKPT {path} is not a file (expected a metaseq/fairseq .pt, or one of its "
                         f"...{PART_MARK}R.pt files)")
    notes, stand_ins, states = [], set(), []
    for part in model_part_paths(path):
        state, used = load_legacy_checkpoint(part)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise UsageError(f"{part}: not a metaseq/fairseq checkpoint (no 'model' state dict)")
        states.append(state)
        stand_ins.update(used)
    if stand_ins:
        notes.append(f"read without importing fairseq/metaseq/omegaconf; stood in as plain data: {', '.join(sorted(stand_ins))}")
    model_cfg, task_cfg, parts_expected = saved_config(states[0], path)
    if parts_expected not in (None, len(states)):
        raise UsageError(f"{path}: the checkpoint was saved with model_parallel_size {parts_expected}, "
                         f"but {len(states)} part file(s) are there")
    merged = merge_parts([state["model"] for state in states], path)
    num_layers = _count_layers(merged)
    ours = to_our_keys(merged, num_layers, path)
    fields = model_fields(model_cfg, task_cfg, ours, num_layers, path)
    if fields["share_decoder_input_output_embed"]:
        ours["decoder.output_projection.weight"] = ours["decoder.embed_tokens.weight"]
    tokenizer = tokenizer_files(hf_tokenizer, vocab_filename, merges_filename, task_cfg)
    return notes + write_weights_only_checkpoint(Path(out), ours, fields, tokenizer, f"CKPT {path}")


def model_part_paths(path: Path) -> List[Path]:
    """[path] for a singleton; for `P-model_part-{r}.pt`, every part r = 0, 1, ... that exists."""
    stem = path.name[: -len(".pt")] if path.name.endswith(".pt") else None
    if stem is None or PART_MARK not in stem or not stem.rsplit(PART_MARK, 1)[1].isdigit():
        return [path]
    prefix = stem.rsplit(PART_MARK, 1)[0]
    parts = []
    while (path.parent / f"{prefix}{PART_MARK}{len(parts)}.pt").is_file():
        parts.append(path.parent / f"{prefix}{PART_MARK}{len(parts)}.pt")
    if not parts:
        raise UsageError(f"{path}: part 0 ({prefix}{PART_MARK}0.pt) is missing")
    return parts


def saved_config(state: Dict[str, Any], path: Path) -> Tuple[Dict[str, Any], Dict[str, Any], Optional[int]]:
    """(model section, task section, model_parallel_size) from `cfg` (metaseq, fairseq >= 0.10) or `args`."""
    from metaseq_ds.convert.restricted_unpickler import plain

    if state.get("cfg"):
        cfg = plain(state["cfg"])
        model, task = cfg.get("model") or {}, cfg.get("task") or {}
        arch = model.get("_name") or model.get("arch")
        sections = [cfg.get("distributed_training") or {}, cfg.get("common") or {}, model]
    elif state.get("args"):
        args = plain(state["args"])
        model, task, arch = args, args, args.get("arch")
        sections = [args]
    else:
        raise UsageError(f"{path}: has neither 'cfg' nor 'args', so its architecture is unknown")
    if not isinstance(arch, str) or not (arch.startswith("transformer_lm") or arch.startswith("model_parallel_transformer_lm")):
        raise UsageError(f"{path}: unknown architecture {arch!r}; import knows metaseq/fairseq transformer_lm "
                         f"and its transformer_lm_* architectures")
    for unsupported in ("adaptive_input", "adaptive_softmax_cutoff", "character_embeddings"):
        if model.get(unsupported):
            raise UsageError(f"{path}: {unsupported} is set; adaptive input/softmax and character embeddings are not supported")
    mp_sizes = [s.get("model_parallel_size") for s in sections if s.get("model_parallel_size")]
    return model, task, (int(mp_sizes[0]) if mp_sizes else None)


def merge_parts(parts: List[Dict[str, torch.Tensor]], path: Path) -> Dict[str, torch.Tensor]:
    """One metaseq state dict (split q/k/v) from model-parallel parts (or a single part)."""
    from metaseq_ds.convert.key_maps import DROPPED_KEYS, FUSED_ORDER, partition_dim

    keys = [k for k in parts[0] if k not in DROPPED_KEYS]
    flattened = [k for k in keys if "flat_param" in k or "_fsdp_wrapped_module" in k]
    if flattened:
        raise UsageError(f"{path}: FSDP-flattened weights ({flattened[0]}); consolidate the -shard files "
                         f"with metaseq's consolidation script first")
    for index, part in enumerate(parts[1:], start=1):
        if set(k for k in part if k not in DROPPED_KEYS) != set(keys):
            raise UsageError(f"{path}: part {index} holds other weights than part 0")
    merged: Dict[str, torch.Tensor] = {}
    for key in keys:
        pieces = [part[key] for part in parts]
        if ".self_attn.qkv_proj." in key:
            for kind, blocks in zip(FUSED_ORDER, zip(*(_split_fused(p, key, path) for p in pieces))):
                merged[key.replace(".qkv_proj.", f".{kind}_proj.")] = torch.cat(blocks, dim=0)
            continue
        dim = partition_dim(key)
        merged[key] = pieces[0] if dim is None or len(pieces) == 1 else torch.cat(pieces, dim=dim)
    return merged


def _split_fused(tensor: torch.Tensor, key: str, path: Path):
    if tensor.shape[0] % 3:
        raise UsageError(f"{path}: {key} has {tensor.shape[0]} rows, not a multiple of 3 (fused K, V, Q)")
    return torch.chunk(tensor, 3, dim=0)


def _count_layers(state: Dict[str, torch.Tensor]) -> int:
    indices = {int(k.split(".")[2]) for k in state if k.startswith("decoder.layers.") and k.split(".")[2].isdigit()}
    return max(indices) + 1 if indices else 0


def to_our_keys(state: Dict[str, torch.Tensor], num_layers: int, path: Path) -> Dict[str, torch.Tensor]:
    from metaseq_ds.convert.key_maps import metaseq_key_map

    keys = metaseq_key_map(num_layers)
    unknown = sorted(set(state) - set(keys))
    if unknown:
        raise UsageError(f"{path}: weight {unknown[0]!r} has no place in a transformer_lm (unknown architecture?)")
    return {keys[name]: tensor for name, tensor in state.items()}


def model_fields(model: Dict[str, Any], task: Dict[str, Any], ours: Dict[str, torch.Tensor], num_layers: int,
                 path: Path) -> Dict[str, Any]:
    """Our model fields: sizes read from the weights where they show, the rest from the saved config."""
    from metaseq_ds.convert.weights_checkpoint import model_fields_or_error

    if "decoder.layers.0.fc1.weight" not in ours or "decoder.embed_tokens.weight" not in ours:
        raise UsageError(f"{path}: no decoder layers or token embeddings; not a transformer_lm checkpoint")
    if not model.get("decoder_attention_heads"):
        raise UsageError(f"{path}: the saved config lacks decoder_attention_heads")
    ffn, embed_dim = ours["decoder.layers.0.fc1.weight"].shape
    input_dim = ours["decoder.embed_tokens.weight"].shape[1]
    learned = "decoder.embed_positions.weight" in ours
    normalize_before = bool(model.get("decoder_normalize_before", False))
    tied = bool(model.get("share_decoder_input_output_embed", False)) or "decoder.output_projection.weight" not in ours
    max_positions = (ours["decoder.embed_positions.weight"].shape[0] - 2 if learned
                     else model.get("max_target_positions") or task.get("tokens_per_sample") or model.get("tokens_per_sample"))
    if not max_positions:
        raise UsageError(f"{path}: neither max_target_positions nor tokens_per_sample is in the saved config")
    return model_fields_or_error({
        "decoder_embed_dim": int(embed_dim),
        "decoder_input_dim": int(input_dim) if input_dim != embed_dim else None,
        "decoder_ffn_embed_dim": int(ffn),
        "decoder_layers": num_layers,
        "decoder_attention_heads": int(model["decoder_attention_heads"]),
        "decoder_normalize_before": normalize_before,
        "no_decoder_final_norm": normalize_before and "decoder.final_layer_norm.weight" not in ours,
        "activation_fn": model.get("activation_fn", "relu"),
        "dropout": float(model.get("dropout", 0.1)),
        "attention_dropout": float(model.get("attention_dropout", 0.0)),
        "activation_dropout": float(model.get("activation_dropout", 0.0) or model.get("relu_dropout", 0.0) or 0.0),
        "share_decoder_input_output_embed": tied,
        "decoder_learned_pos": learned,
        "no_token_positional_embeddings": bool(model.get("no_token_positional_embeddings", False)),
        "no_scale_embedding": bool(model.get("no_scale_embedding", False)),
        "max_target_positions": int(max_positions),
    }, f"CKPT {path}")


def tokenizer_files(hf_tokenizer, vocab_filename, merges_filename, task: Dict[str, Any]) -> Dict[str, Path]:
    """The flags' tokenizer files, else those the checkpoint recorded if they still exist."""
    given = {"hf_tokenizer": hf_tokenizer, "vocab_filename": vocab_filename, "merges_filename": merges_filename}
    if any(given.values()):
        if bool(vocab_filename) != bool(merges_filename):
            raise UsageError("--vocab-filename and --merges-filename go together")
        for flag, value in given.items():
            if value and not Path(value).is_file():
                raise UsageError(f"--{flag.replace('_', '-')}: file {value} does not exist")
        return {k: Path(v) for k, v in given.items() if v}
    recorded = {k: task.get(k) for k in ("hf_tokenizer", "vocab_filename", "merges_filename")}
    found = {k: Path(v) for k, v in recorded.items() if isinstance(v, str) and v and Path(v).is_file()}
    if "hf_tokenizer" in found:
        return {"hf_tokenizer": found["hf_tokenizer"]}
    if "vocab_filename" in found and "merges_filename" in found:
        return {k: found[k] for k in ("vocab_filename", "merges_filename")}
    return {}
