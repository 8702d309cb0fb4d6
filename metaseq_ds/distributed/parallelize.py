"""Apply memory/parallelism transforms to a plain model, after construction, in one place.

torchtitan's order: tensor parallelism (the plan in `tensor_parallel`), then activation
checkpointing, then regional compilation; the data-parallel wrapper (the DeepSpeed engine, ZeRO) comes last, in the
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
    if cfg.distributed_training.compile_layers:
        compile_layers(model)
    gather_layers_whole(model)
    return model


def gather_layers_whole(model: torch.nn.Module) -> None:
    """Make each decoder layer a ZeRO-3 leaf module (nothing changes under other stages): ZeRO-3
    then gathers, and releases, a layer's parameters in one hook on the layer instead of one on
    each of its linear layers and norms, whose Python cost the host pays 4 times a step for
    each (measured on the CPU, one rank, bf16: a ZeRO-3 step 9% slower than ZeRO-0's with a hook
    per submodule, equal with one per layer). A rank gathers no more than before: ZeRO-3's
    live-parameter limit is one layer, two on a GPU, the next prefetched (`deepspeed_config._bucket_sizes`).
    """
    from deepspeed.utils import set_z3_leaf_module

    for layer in getattr(getattr(model, "decoder", None), "layers", ()):
        set_z3_leaf_module(layer, True)


def decoder_layers(model: torch.nn.Module, flag: str) -> torch.nn.ModuleList:
    layers = getattr(getattr(model, "decoder", None), "layers", None)
    if layers is None:
        raise UsageError(f"{flag}: {type(model).__name__} has no decoder.layers")
    return layers


def compile_layers(model: torch.nn.Module) -> None:
    """Regional compilation, as torch recommends for transformers: each decoder layer's forward
    `torch.compile`d. The layers share their code, so dynamo makes one graph for all of them
    (the parameters are the graph's inputs), compiled at the first forward.

    The forward is compiled, not the module's call, so the module's hooks run around the compiled
    code: ZeRO-3 gathers and releases parameters in hooks that dynamo cannot trace, which would
    break the graph at every linear layer; and it gathers a layer's parameters in one hook on the
    layer (`gather_layers_whole`), none on its submodules.
    """
    for layer in decoder_layers(model, "--compile-layers"):
        layer.forward = torch.compile(layer.forward)


# torch 2.11 trains layers compiled this way under ZeRO-3 to wrong losses (the tiny model of
# tests/test_compile_layers.py: 0.3% off eager at the 3rd update, 1.2% at the 5th, and a graph
# compiled for each layer); 2.12 trains as eager (a graph for each layer), 2.13 as eager in one graph.
ZERO3_COMPILE_MIN_TORCH = (2, 12)


def check_compile_layers(compile_layers: bool, zero_stage: int) -> None:
    """Stop before any work where `--compile-layers` would train wrongly: under ZeRO-3 on a torch
    older than ZERO3_COMPILE_MIN_TORCH."""
    if compile_layers and zero_stage == 3 and torch.__version__ < ZERO3_COMPILE_MIN_TORCH:
        minimum = ".".join(map(str, ZERO3_COMPILE_MIN_TORCH))
        raise UsageError(f"--compile-layers under ZeRO-3 needs torch {minimum} or newer: torch {torch.__version__} "
                         f"trains the compiled layers to losses unlike eager ones (measured); upgrade torch, "
                         f"or train eager (leave out --compile-layers), or under ZeRO-0/1/2")


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward pass instead of keeping its activations.

    The layer's `forward` is replaced on the instance, so parameter names (and checkpoints)
    stay exactly those of the plain model.
    """
    for layer in decoder_layers(model, "--checkpoint-activations"):
        layer.forward = _checkpointed(layer.forward)


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
