"""Tiny models and checkpoints for the conversion tests (export, import, errors)."""

from pathlib import Path
from types import SimpleNamespace

import torch

from metaseq_ds.checkpoint.files import write_module_checkpoint
from metaseq_ds.data import Dictionary
from metaseq_ds.models.transformer_lm import TransformerLanguageModel

VOCAB = 264  # the byte tokenizer's 260 ids, padded to a multiple of 8

TINY_MODEL = ["--arch", "transformer_lm", "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64",
              "--decoder-layers", "2", "--decoder-attention-heads", "4", "--decoder-learned-pos",
              "--decoder-normalize-before", "--share-decoder-input-output-embed", "--no-scale-embedding",
              "--tokens-per-sample", "16", "--init-std", "0.2"]

VARIANTS = ["pre_ln", "post_ln_350m_like", "gelu"]


def variant_flags(variant: str):
    if variant == "post_ln_350m_like":  # post-LN, word_embed_proj_dim != hidden_size
        return [f for f in TINY_MODEL if f != "--decoder-normalize-before"] + ["--decoder-input-dim", "16"]
    if variant == "gelu":
        return TINY_MODEL + ["--activation-fn", "gelu"]
    return list(TINY_MODEL)


def build_model(model_cfg, seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    return TransformerLanguageModel.build_model(model_cfg, SimpleNamespace(dictionary=Dictionary.of_size(vocab))).eval()


def write_zero0_checkpoint(save_dir: Path, flags, seed: int = 0, vocab: int = VOCAB):
    """A checkpoint as `mseq train` saves it with ZeRO-0 on one rank (weights only matter here);
    `vocab`: the dictionary's size, padded (the byte tokenizer's by default)."""
    from metaseq_ds.options import parse_train_config

    cfg = parse_train_config(flags)
    model = build_model(cfg.model, seed, vocab)
    write_module_checkpoint(save_dir, "checkpoint_1_0", model.state_dict(), {"config": cfg.to_dict()})
    return model, cfg


def model_of_checkpoint(path):
    """Our model with a checkpoint's weights, built from its meta config (no data needed)."""
    from metaseq_ds.checkpoint.files import find_checkpoint
    from metaseq_ds.checkpoint.read import load_model_weights
    from metaseq_ds.options import config_from_dict

    ref = find_checkpoint(str(path))
    cfg = config_from_dict(ref.meta()["config"])
    weights = load_model_weights(ref)
    model = build_model(cfg.model, seed=99, vocab=weights["decoder.embed_tokens.weight"].shape[0])
    model.load_state_dict(weights)
    return model, cfg


def tokens(batch: int = 3, length: int = 12, seed: int = 1):
    return torch.randint(4, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
