"""Megatron-style tensor parallelism, applied to the plain model as a plan of module swaps.

`TP_PLAN` names each module to shard and how; `apply_tensor_parallel` swaps each for
DeepSpeed's layer of that kind (`deepspeed.module_inject.layers`), built from the full module:
every rank first builds the same full model (same seed) and keeps only its slice.

- column (q/k/v_proj, fc1): `LinearLayer`, output features split, so each rank computes its
  own heads and its slice of the FFN; the backward all-reduces the input gradient.
- row (out_proj, fc2): `LinearAllreduce`, input features split; partial outputs are summed.
- vocab_head (output_projection): `VocabParallelLinear`, vocabulary rows split. Given targets
  (training, validation) it returns the loss, fused with the projection over its shard
  (`modules.cross_entropy.vocab_parallel_linear_cross_entropy`): no logits, whole or sharded.
  Without (generation), the logits are gathered unless the criterion reads the shards
  (`vocab_parallel_cross_entropy`).
- vocab_embedding (embed_tokens): `VocabParallelEmbedding`; a tied embedding shares the head's shard.

Attention reads its head count from its projections' width, so heads split with q/k/v.
Everything else (LayerNorms, positions, row-parallel biases) is replicated.

Dropout (Megatron's rule): masks on replicated activations must be equal on the ranks of one
tensor-parallel group, and masks on sharded ones (attention probabilities of this rank's
heads, the FFN's hidden slice) must differ. The trainer seeds by data-parallel rank, which
gives the first; the sharded regions run under a generator forked per tensor-parallel rank.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from metaseq_ds.errors import UsageError

if TYPE_CHECKING:  # torch loads only when a model is sharded: flag checks stay instant
    from torch import nn

TP_PLAN = (
    ("decoder.output_projection", "vocab_head"),  # before the embedding: a tied embedding shares its shard
    ("decoder.embed_tokens", "vocab_embedding"),
    ("decoder.layers.*.self_attn.q_proj", "column"),
    ("decoder.layers.*.self_attn.k_proj", "column"),
    ("decoder.layers.*.self_attn.v_proj", "column"),
    ("decoder.layers.*.self_attn.out_proj", "row"),
    ("decoder.layers.*.fc1", "column"),
    ("decoder.layers.*.fc2", "row"),
)
# Dimension along which each style splits a parameter; None: replicated on every rank.
PARTITION_DIMS = {
    "column": {"weight": 0, "bias": 0},
    "row": {"weight": 1, "bias": None},
    "vocab_head": {"weight": 0},
    "vocab_embedding": {"weight": 0},
}
# Where the sharded activations are, for the per-rank dropout generator.
SHARDED_DROPOUT_REGIONS = ("decoder.layers.*.self_attn", "decoder.layers.*.activation_dropout")
_TP_RNG_OFFSET = 2718  # Megatron's offset of the model-parallel seed


def tensor_parallel_size(cfg) -> int:
    dist_cfg = cfg.distributed_training
    return max(dist_cfg.model_parallel_size, dist_cfg.tensor_parallel_size)


def check_divisible(model_cfg, size: int, source: str = "--model-parallel-size") -> None:
    """The model splits evenly across `size` ranks, or a one-line error (checked before building)."""
    if size <= 1:
        return
    flag = f"{source} {size}"
    for field, what in (("decoder_attention_heads", "each rank holds whole heads"),
                        ("decoder_ffn_embed_dim", "each rank holds an equal slice of the FFN")):
        value = getattr(model_cfg, field, None)
        if value is not None and value % size != 0:
            raise UsageError(f"{flag} does not divide --{field.replace('_', '-')} {value} ({what})")


def check_world(size: int, world_size: int) -> None:
    if size <= 1:
        return
    if size > world_size:
        raise UsageError(f"--model-parallel-size {size} exceeds the {world_size} rank(s) the launcher started "
                         f"(start at least {size}, e.g. deepspeed --num_gpus {size})")
    if world_size % size != 0:
        raise UsageError(f"--model-parallel-size {size} does not divide the {world_size} ranks "
                         f"(the ranks form data-parallel x tensor-parallel groups)")


def _planned_style(module_name: str) -> Optional[str]:
    for pattern, style in TP_PLAN:
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


def partition_dim(param_name: str) -> Optional[int]:
    """The dimension along which `param_name` (a plain model's state-dict key) is sharded, or None."""
    module_name, _, leaf = param_name.rpartition(".")
    style = _planned_style(module_name)
    return None if style is None else PARTITION_DIMS[style].get(leaf)


def is_vocabulary_parameter(param_name: str) -> bool:
    """Whether `param_name` has a row per vocabulary entry (the embedding and output projection)."""
    return _planned_style(param_name.rpartition(".")[0]) in ("vocab_head", "vocab_embedding")


def partition_dims(state_dict_keys) -> Dict[str, int]:
    """The sharded parameters of a checkpoint and their split dimension (its merge metadata)."""
    return {name: dim for name in state_dict_keys if (dim := partition_dim(name)) is not None}


def merge_shards(shards: List[Dict[str, Any]], dims: Dict[str, int], concat=None) -> Dict[str, Any]:
    """Full tensors from the per-rank state dicts of a tensor-parallel checkpoint (rank order).

    `concat(parts, dim)` joins one tensor's shards (default `torch.cat`; checkpoint readers pass
    a lazy one). Tied names share one tensor in each shard, and share one merged tensor too.
    """
    if concat is None:
        import torch

        concat = torch.cat
    merged: Dict[str, Any] = {}
    by_identity: Dict[int, Any] = {}
    for name, first in shards[0].items():
        if id(first) not in by_identity:
            dim = dims.get(name)
            by_identity[id(first)] = first if dim is None else concat([shard[name] for shard in shards], dim)
        merged[name] = by_identity[id(first)]
    return merged


def apply_tensor_parallel(model: nn.Module, gather_logits: bool = True) -> nn.Module:
    """Swap the planned modules of `model` for DeepSpeed's tensor-parallel layers, in place.

    A no-op without a tensor-parallel group of several ranks (one process, or TP 1).
    """
    from metaseq_ds.distributed import utils as dist_utils

    size = dist_utils.get_tensor_model_parallel_world_size()
    if size <= 1:
        return model
    from deepspeed.module_inject.layers import (
        LinearAllreduce,
        LinearLayer,
        VocabParallelEmbedding,
        VocabParallelLinear,
        set_autotp_mode,
    )

    from metaseq_ds.modules.cross_entropy import vocab_parallel_linear_cross_entropy
    from metaseq_ds.modules.linear import linear
    from metaseq_ds.private_apis.deepspeed_tensor_parallel import even_split_tp_meta, tp_forward_saving_the_parameter

    # Training mode: DeepSpeed's layers then use autograd-safe (not in-place) ops.
    set_autotp_mode(training=True)
    group = dist_utils.get_tensor_model_parallel_group()
    meta = even_split_tp_meta()  # divisibility was checked up front
    decoder = model.decoder
    tied = decoder.output_projection.weight is decoder.embed_tokens.weight
    planned = [(name, module, _planned_style(name)) for name, module in model.named_modules()]
    head = None
    for name, module, style in sorted((p for p in planned if p[2]), key=lambda p: p[2] != "vocab_head"):
        kwargs = {"tp_meta": meta, "name": name}
        if style == "column":
            layer = LinearLayer(module, group, **kwargs)
        elif style == "row":
            layer = LinearAllreduce(module, group, **kwargs)
        elif style == "vocab_head":
            layer = head = VocabParallelLinear(module, group, **kwargs)
            layer.gather_output = gather_logits
        else:
            layer = VocabParallelEmbedding(module, group, tied_vocab_parallel_linear=head if tied else None, **kwargs)
        if style != "vocab_embedding":  # so that ZeRO-3 can free each layer's gathered weight after its forward
            loss = vocab_parallel_linear_cross_entropy if style == "vocab_head" else None
            layer.forward = tp_forward_saving_the_parameter(layer, row_parallel=style == "row", linear=linear, loss=loss)
        _replace(model, name, layer)
    tp_rank = dist_utils.get_tensor_model_parallel_rank()
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in SHARDED_DROPOUT_REGIONS) and _has_dropout(module):
            module.forward = _with_rank_generator(module, module.forward, tp_rank)
    model.ds_autotp_parsed = True  # tells DeepSpeed's engine the model is sharded already
    return model


def _replace(model: nn.Module, name: str, layer: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)


def _has_dropout(module: nn.Module) -> bool:
    return getattr(module, "attention_dropout", 0.0) > 0 or getattr(module, "p", 0.0) > 0


def _with_rank_generator(module: nn.Module, forward, tp_rank: int):
    """Run `forward` with a generator seeded per tensor-parallel rank, then restore the shared one.

    The seed is drawn from the shared generator, so it is the same draw on every rank of the
    group (offset by the rank), and activation checkpointing, which replays the shared
    generator's state, replays the same masks.
    """
    import torch

    def run(*args, **kwargs):
        if not module.training:
            return forward(*args, **kwargs)
        seed = int(torch.randint(0, 2**62, (1,)))
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + _TP_RNG_OFFSET + tp_rank)
            return forward(*args, **kwargs)

    return run
