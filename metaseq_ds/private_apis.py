"""Every private DeepSpeed and torch API metaseq_ds uses, in one place, behind a version check.

Upstream may change these without notice, so each is wrapped here in one small function that
says what it relies on, and nothing else in metaseq_ds reaches into DeepSpeed's or torch's
internals. `TESTED` lists the versions they were verified with; on another version the first
use of a shim stops with one line naming the API and the versions (set
`METASEQ_DS_ALLOW_UNTESTED=1` to try anyway, with a warning). `tests/test_private_apis.py`
holds one test per shim that fails when upstream changes the behaviour relied on.

Public upstream APIs (deepspeed.initialize, DeepSpeed's TP layers, zero_to_fp32's public
functions, torch.load) are used directly where they are needed.
"""

import functools
import os
import warnings
from importlib import metadata
from typing import Any, Callable, Dict, List, Tuple

from metaseq_ds.errors import UsageError

# Major.minor versions the shims were verified with.
TESTED = {"deepspeed": ("0.19",), "torch": ("2.13",)}
ALLOW_UNTESTED = "METASEQ_DS_ALLOW_UNTESTED"


@functools.lru_cache(maxsize=None)
def require_tested(package: str, api: str) -> None:
    """Stop with one line when `package` is not a version `api` was verified with."""
    version = metadata.version(package)
    if ".".join(version.split(".")[:2]) in TESTED[package]:
        return
    message = (f"metaseq_ds relies on {package}'s private {api}, verified with {package} "
               f"{' or '.join(v + '.x' for v in TESTED[package])}; this is {package} {version}")
    if os.environ.get(ALLOW_UNTESTED):
        warnings.warn(message + f" ({ALLOW_UNTESTED} is set: trying anyway)", stacklevel=3)
        return
    raise UsageError(f"{message}: install a verified version, or set {ALLOW_UNTESTED}=1 to try anyway")


# -- torch ---------------------------------------------------------------------------------------

def onednn_linear(x, weight, bias=None):
    """x @ weight.T (+ bias) on oneDNN, for fp32 CPU tensors; either operand may be a transposed
    view. `torch.ops.mkldnn._linear_pointwise` is the op torch's own inductor lowers linear layers
    to on the CPU; it is not public API."""
    require_tested("torch", "torch.ops.mkldnn._linear_pointwise")
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def weights_only_allowed_globals() -> Dict[str, Any]:
    """The classes and functions `torch.load(weights_only=True)` accepts, by qualified name (its
    tensor rebuild functions among them): the base of our restricted unpickler."""
    require_tested("torch", "torch._weights_only_unpickler._get_allowed_globals")
    from torch import _weights_only_unpickler

    return dict(_weights_only_unpickler._get_allowed_globals())


# -- DeepSpeed: process groups and tensor parallelism --------------------------------------------

def init_tensor_parallel_groups(tensor_parallel_size: int) -> None:
    """DeepSpeed's (data-parallel x tensor-parallel) groups, ranks r..r+N-1 forming one TP group:
    what its AutoTP sets up through `deepspeed.initialize`, needed here before the model exists."""
    require_tested("deepspeed", "deepspeed.utils.groups._init_tp_mesh_device")
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tensor_parallel_size)


def tensor_parallel_groups_initialized() -> bool:
    """Whether `init_tensor_parallel_groups` ran in this process (DeepSpeed keeps no public flag)."""
    require_tested("deepspeed", "deepspeed.utils.groups._TENSOR_MODEL_PARALLEL_GROUP")
    from deepspeed.utils import groups

    return groups._TENSOR_MODEL_PARALLEL_GROUP is not None


def even_split_tp_meta():
    """The `tp_meta` argument of DeepSpeed's TP layers that splits every dimension into exactly
    equal parts (grain 1): our checks guarantee divisibility, and checkpoints merge by equal parts."""
    require_tested("deepspeed", "deepspeed.module_inject.tp_shard.AutoTPMeta")
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    return AutoTPMeta(tp_grain_size=1)


# -- DeepSpeed: ZeRO internals -------------------------------------------------------------------

def zero3_flat_partitions(zero_optimizer) -> List[Tuple[Any, Any]]:
    """(fp32 master partition, training-dtype parameter partition) per parameter group of a
    ZeRO-3 optimizer: the flat buffers DeepSpeed steps and copies between."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat")
    return list(zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_partitioned_groups_flat))


def zero3_gradient_buffer(zero_optimizer):
    """The flat buffer a ZeRO-3 optimizer keeps this rank's gradient partitions in (memory figures)."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer_Stage3.grad_partitions_flat_buffer")
    return zero_optimizer.grad_partitions_flat_buffer


def consolidate_zero_shards(folder: str, tensor_parallel_rank: int) -> Dict[str, Any]:
    """The fp32 weights of one tensor-parallel rank of a ZeRO-1/2/3 checkpoint in `folder`,
    consolidated over its data-parallel shards (memory-mapped where DeepSpeed allows).

    zero_to_fp32's public entry point takes the whole folder and refuses a save of several
    tensor-parallel ranks; its per-stage workers, given one rank's files, do the job."""
    require_tested("deepspeed", "zero_to_fp32._get_fp32_state_dict_from_zero{2,3}_checkpoint")
    from deepspeed.utils import zero_to_fp32

    pattern = f"mp_rank_{tensor_parallel_rank:02d}"
    model_states = zero_to_fp32.parse_model_states(
        zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_model_states.pt"))
    stage, dp_size, flat_groups, paddings = zero_to_fp32.parse_optim_states(
        zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_optim_states.pt"), folder)
    if stage <= 2:
        return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(dp_size, flat_groups, model_states, False, paddings)
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(dp_size, flat_groups, model_states, False)


def checkpoint_file_classes() -> List[type]:
    """The few DeepSpeed classes pickled into its checkpoint files besides tensors and containers
    (loss scalers, the ZeRO stage enum, fragment addresses): what a weights-only load must accept."""
    require_tested("deepspeed", "the classes pickled in its checkpoint files")
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler, torch.Size]


def replace_checkpoint_loader(engine, load: Callable[..., Any]) -> None:
    """Make `engine.load_checkpoint` read every file with `load(path, map_location=None)`.

    The engine reads files through its `checkpoint_engine` attribute (not a public hook), whose
    default unpickles arbitrary objects; the rest of that object (saving) is kept."""
    require_tested("deepspeed", "DeepSpeedEngine.checkpoint_engine")
    engine.checkpoint_engine = _LoadOverride(engine.checkpoint_engine, load)


class _LoadOverride:
    def __init__(self, inner, load: Callable[..., Any]):
        self._inner, self._load = inner, load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return self._load(path, map_location=map_location)
