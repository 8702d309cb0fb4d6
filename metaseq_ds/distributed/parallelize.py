"""Apply memory/parallelism transforms to a plain model, after construction, in one place.

torchtitan's order: tensor parallelism (the plan in `tensor_parallel`), then activation
checkpointing; the data-parallel wrapper (the DeepSpeed engine, ZeRO) comes last, in the
trainer. Model code never knows about any of this.
"""

import torch
import torch.utils.checkpoint

from metaseq_ds.dataclass import MetaseqConfig
from metaseq_ds.distributed.tensor_parallel import apply_tensor_parallel
from metaseq_ds.errors import UsageError


def parallelize(model: torch.nn.Module, cfg: MetaseqConfig, criterion=None) -> torch.nn.Module:
    """`model` (plain, whole) sharded by the tensor-parallel plan over this process's group, with
    activation checkpointing if configured. The logits are gathered unless `criterion` (a `BaseCriterion`) reads
    the vocabulary shards (without a criterion, as in generation, they are gathered)."""
    reads_shards = criterion is not None and criterion.reads_vocab_parallel_logits
    apply_tensor_parallel(model, gather_logits=not reads_shards)
    if cfg.distributed_training.checkpoint_activations:
        apply_activation_checkpointing(model)
    return model


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward pass instead of keeping its activations.

    The layer's `forward` is replaced on the instance, so parameter names (and checkpoints)
    stay exactly those of the plain model.
    """
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        raise UsageError(f"--checkpoint-activations: {type(model).__name__} has no decoder.layers to checkpoint")
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
