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
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

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


def tp_forward_saving_the_parameter(layer, row_parallel: bool, product: Optional[Callable[[Any], Any]] = None):
    """A forward for one of DeepSpeed's TP layers (`LinearLayer`/`VocabParallelLinear`: column
    parallel; `LinearAllreduce`: row parallel) that multiplies through `modules.linear.linear`
    where DeepSpeed's multiplies by `self.weight.transpose(-1, -2)`. Same collectives (its
    autograd functions) and result; but autograd then saves the parameter, not a view of its
    data, so ZeRO-3 frees each gathered weight after the forward: DeepSpeed's view kept every
    layer's gathered weight alive until the backward (707M model, TP=2 x DP=2: +80 MB a layer).
    Only DeepSpeed's default path (no overlapped or compiler-deferred collectives), the one
    metaseq_ds runs; otherwise the layer's own forward is returned. (Checked on 2 ranks by
    tests/test_tensor_parallel.py: parity with the unsharded model, no saved view of a weight.)

    `product(input)`, for a column-parallel layer, replaces its local product (input @ Wᵀ + bias):
    the streamed tied embedding's (`distributed.tied_embedding`) never gathers W whole."""
    require_tested("deepspeed", "module_inject.layers' tensor-parallel autograd functions and layer attributes")
    from deepspeed.module_inject import layers as tp

    from metaseq_ds.modules.linear import linear

    if type(layer).tp_overlap_comm or layer.defer_collectives_to_compiler:
        if product is not None:
            raise NotImplementedError(
                "a streamed product under DeepSpeed's overlapped or compiler-deferred TP collectives")
        return layer.forward
    if product is None:
        def product(input):
            return linear(input, layer.weight, layer.bias)

    def row_forward(input):
        output = tp.RowParallel.apply(layer.mp_group, linear(input, layer.weight), not layer.is_training_mode())
        return output if layer.bias is None else output + layer.bias

    def column_forward(input):
        if layer.mp_group is not None:
            input = tp.ColumnParallel.apply(layer.mp_group, input)
        output = product(input)
        if layer.gather_output:
            output = tp.GatherFromTensorParallelRegion.apply(layer.mp_group, output, layer._partition_sizes)
        return output

    return row_forward if row_parallel else column_forward


def tp_vocab_embedding_forward(layer, lookup: Callable[[Any], Any]):
    """DeepSpeed's `VocabParallelEmbedding.forward` with its local lookup replaced by
    `lookup(rows)`: the rows of this rank's vocabulary shard, zeros for rows outside it (so no
    mask is needed). Same collective (its `RowParallel` sum over the tensor-parallel group) and
    scale. (Checked by tests/test_tensor_parallel.py: TP=2 x DP=2 under ZeRO-3, on 4 ranks,
    follows one rank's losses.)"""
    require_tested("deepspeed", "module_inject.layers' VocabParallelEmbedding attributes and RowParallel")
    from deepspeed.module_inject import layers as tp

    def forward(input):
        output = lookup(input - layer.vocab_start_index)
        if layer.is_tp_parallel:
            output = tp.RowParallel.apply(layer.mp_group, output, not layer.is_training_mode())
        if layer.embed_scale is not None:
            output = output * layer.embed_scale.to(output.dtype)
        return output

    return forward


# -- DeepSpeed: the CPU accelerator's shared-memory all-reduce --------------------------------

def shm_allreduce_buffer(rank: int) -> Path:
    """The file in /dev/shm that DeepSpeed's shared-memory all-reduce op (`csrc/cpu/comm/shm.cpp`,
    built and initialised by `deepspeed.init_distributed()` when all ranks share one machine)
    creates for `rank`: ~66 MB, named from the user, MASTER_ADDR and MASTER_PORT, and never
    unlinked by DeepSpeed. Each rank creates its own and maps every other rank's while it
    initialises; after that no rank opens one by name again."""
    require_tested("deepspeed", "the name of csrc/cpu/comm/shm.cpp's all-reduce buffer")
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


# -- DeepSpeed: its communication backend --------------------------------------------------------

def route_deepspeed_collectives(all_gather_into_tensor: Callable[..., Any], reduce_scatter_tensor: Callable[..., Any]) -> None:
    """Make these (torch's signatures) the functions behind every all-gather and reduce-scatter of
    DeepSpeed's communication backend (`deepspeed.comm`'s `cdb.all_gather_function` and
    `cdb.reduce_scatter_function`, which ZeRO reaches through `dist.allgather_fn`,
    `dist.all_gather_into_tensor` and `dist.reduce_scatter_fn`). Initialises `deepspeed.comm` on
    the existing process group first if it is not yet. (Checked on 3 ranks by
    tests/test_gloo_collectives.py: DeepSpeed's entry points reach them.)"""
    require_tested("deepspeed", "deepspeed.comm.comm.cdb's all_gather_function and reduce_scatter_function")
    import deepspeed
    from deepspeed.comm import comm

    if comm.cdb is None or not comm.cdb.is_initialized():
        deepspeed.init_distributed()
    comm.cdb.all_gather_function = all_gather_into_tensor
    comm.cdb.reduce_scatter_function = reduce_scatter_tensor


# -- DeepSpeed: ZeRO internals -------------------------------------------------------------------

def zero3_flat_partitions(zero_optimizer) -> List[Tuple[Any, Any]]:
    """(fp32 master partition, training-dtype parameter partition) per parameter group of a
    ZeRO-3 optimizer: the flat buffers DeepSpeed steps and copies between."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat")
    return list(zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_partitioned_groups_flat))


def zero12_flat_partitions(zero_optimizer) -> List[Tuple[Any, Any]]:
    """(fp32 master partition, training-dtype parameter partition) per parameter group of a
    ZeRO-1/2 optimizer: the flat buffers DeepSpeed steps and copies between."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups")
    return [(master, zero_optimizer.parallel_partitioned_bit16_groups[i][_zero12_partition_id(zero_optimizer, i)])
            for i, master in enumerate(zero_optimizer.single_partition_of_fp32_groups)]


def _zero12_partition_id(zero_optimizer, group: int) -> int:
    import deepspeed.comm as dist

    return dist.get_rank(group=zero_optimizer.real_dp_process_group[group])


def relink_zero12_master_fragments(zero_optimizer) -> None:
    """After a ZeRO-1/2 master partition got new storage: each parameter's view of its fp32
    fragment (`param._hp_mapping`, what `safe_get_full_fp32_param` and universal checkpoints
    read) was a view of the old storage; DeepSpeed's own linking makes them again, and the
    optimizer-state fragments are linked afresh at the first step."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer._link_all_hp_params")
    zero_optimizer._link_all_hp_params()
    zero_optimizer._hp_optimizer_states_linked = False


def zero3_partition_start(param, group_rank: int) -> int:
    """Where rank `group_rank`'s partition of a ZeRO-3 parameter starts in the flattened parameter.
    ZeRO-3 cuts the flattened parameter (padded at its end) into equal contiguous partitions, rank
    r of its group holding elements [r * n, (r + 1) * n) for n = the partition's size; the
    gradient partitions follow the same layout. (Checked on 2 ranks: tests/test_tied_embedding.py.)"""
    require_tested("deepspeed", "ZeRO-3's contiguous partitions of a flattened parameter (ds_tensor)")
    return group_rank * param.ds_tensor.ds_numel


def stop_zero3_gathering(engine, modules) -> None:
    """Remove the hooks ZeRO-3 registered on each of `modules` (not their children), so it never
    gathers their own parameters: not before their forward, nor before their backward. Whoever
    calls this reads those parameters' partitions itself. DeepSpeedZeRoOffload keeps the handles
    of the four hooks it puts on every module (`forward_hooks`, `backward_hooks`); each is removed
    from its module's hook dict. (Checked on 2 ranks by tests/test_tied_embedding.py: the tied
    weight is never gathered.)"""
    require_tested("deepspeed", "DeepSpeedZeRoOffload's forward_hooks and backward_hooks handles")
    offload = engine.optimizer.parameter_offload
    hook_dicts = {id(hooks) for module in modules for hooks in (module._forward_pre_hooks, module._forward_hooks)}
    for handle in offload.forward_hooks + offload.backward_hooks:
        if id(handle.hooks_dict_ref()) in hook_dicts:
            handle.remove()


def zero_gradient_norms_in_pieces(zero_optimizer, piece_elements: int) -> None:
    """Make a ZeRO-1/2/3 optimizer's gradient norm (`get_grad_norm_direct(gradients, params)`,
    which copies each gradient to fp64 whole) see gradients of more than `piece_elements` as
    consecutive pieces, each paired with its parameter: the same norm, in fp64, with a transient
    of one piece. ZeRO-1/2's padding tensors (`_zero_padding`, which its norm skips and pairs with
    no parameter) pass as they are. (Checked by tests/test_zero_step.py: the same norms and
    losses, the pieces reach DeepSpeed's norm.)"""
    require_tested("deepspeed", "the ZeRO optimizers' get_grad_norm_direct(gradients, params) and _zero_padding")
    norm_of_whole_gradients = zero_optimizer.get_grad_norm_direct

    def norm_of_pieces(gradients, params, norm_type=2):
        pieces, owners, params = [], [], iter(params)
        for gradient in gradients:
            if getattr(gradient, "_zero_padding", False):
                pieces.append(gradient)
                continue
            param = next(params)
            parts = gradient.reshape(-1).split(piece_elements) if gradient.numel() > piece_elements else (gradient,)
            pieces.extend(parts)
            owners.extend([param] * len(parts))
        return norm_of_whole_gradients(pieces, owners, norm_type)

    zero_optimizer.get_grad_norm_direct = norm_of_pieces


def zero3_reduce_full_buckets_at_once(zero_optimizer) -> None:
    """Make ZeRO-3 reduce-scatter a gradient bucket as soon as it holds `reduce_bucket_size`
    elements. DeepSpeed learns that a bucket is full only when the next gradient would not fit
    (`reduce_independent_p_g_buckets_and_remove_grads`), so a gradient larger than the bucket,
    which is reduced on its own anyway, is held whole until the next module's backward has made
    its own gradient: at 707M with TP=2, fc2's 33 MB gradient beside fc1's gathered weight and
    fc1's gradient. Reducing it at once issues the same collectives in the same order, one
    gradient earlier (on a GPU, on ZeRO's reduce stream). (Checked by tests/test_zero_step.py:
    the same losses, no gradient bucket left full.)"""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer_Stage3's ipg_buckets and __reduce_and_partition_ipg_grads")
    add_to_bucket = zero_optimizer.reduce_independent_p_g_buckets_and_remove_grads
    reduce_bucket = zero_optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads

    def add_and_reduce_when_full(param) -> None:
        add_to_bucket(param)
        comm_dtype = zero_optimizer.get_param_comm_dtype(param)
        if zero_optimizer.ipg_buckets[comm_dtype].elements >= zero_optimizer.reduce_bucket_size:
            reduce_bucket(comm_dtype)

    zero_optimizer.reduce_independent_p_g_buckets_and_remove_grads = add_and_reduce_when_full


def zero3_step_on_the_gradient_buffer(zero_optimizer) -> None:
    """Make ZeRO-3's step give each optimizer sub-group, as its fp32 gradient, the span of the flat
    gradient buffer its gradients already lie in, where `_prepare_fp32_grad_for_sub_group`
    concatenates them into a new tensor (`self.flatten(averaged_gradients[i]).to(fp32)`): in fp32
    training that is a copy of up to a sub-group (12 d*d elements: 200 MB at width 2048) on top
    of the step. Sub-groups whose gradients are not adjacent fp32 spans of that buffer (bf16, fp16
    training) keep DeepSpeed's copy. The buffer is then unscaled and clipped in place; ZeRO-3
    overwrites it at the next update's first micro-step. (Checked by tests/test_zero_step.py: the
    same losses, the optimizer reads the buffer.)"""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group and averaged_gradients")
    concatenate = zero_optimizer._prepare_fp32_grad_for_sub_group
    buffer = zero_optimizer.grad_partitions_flat_buffer

    def prepare(sub_group_id: int) -> None:
        grads = zero_optimizer.averaged_gradients[sub_group_id]
        master = zero_optimizer.fp32_partitioned_groups_flat[sub_group_id]
        span = _adjacent_span(grads, buffer)
        if span is None or span.dtype != master.dtype or span.numel() != master.numel():
            concatenate(sub_group_id)
            return
        master.grad = span
        zero_optimizer.averaged_gradients[sub_group_id] = None

    zero_optimizer._prepare_fp32_grad_for_sub_group = prepare


def _adjacent_span(tensors, buffer):
    """The span of flat `buffer` that `tensors` (1-D views of it) fill one after another, else None."""
    if not tensors or buffer is None:
        return None
    storage = buffer.untyped_storage().data_ptr()
    offset = tensors[0].storage_offset()
    for tensor in tensors:
        if (tensor.dim() != 1 or not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage
                or tensor.storage_offset() != offset):
            return None
        offset += tensor.numel()
    start = tensors[0].storage_offset() - buffer.storage_offset()
    return buffer.narrow(0, start, offset - tensors[0].storage_offset())


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


def zero_checkpoint_values(folder: str, tensor_parallel_rank: int, key: str) -> Dict[str, Any]:
    """One tensor-parallel rank's per-parameter `key` of a ZeRO-1/2/3 checkpoint in `folder`,
    consolidated over its data-parallel shards: "fp32" (the master weights) or an optimizer state
    ("exp_avg", "exp_avg_sq"). ZeRO-3 values are read lazily (`.contiguous()`) from memory-mapped
    files; ZeRO-1/2 ones are views of each parameter group joined over the ranks.

    zero_to_fp32's per-stage workers consolidate the fp32 master partitions; the base optimizer's
    state tensors are flat partitions of the same layout (one flat parameter per group, DeepSpeed
    saves them without the alignment padding or with it at the end), so handing those workers the
    moments instead of the master weights consolidates the moments."""
    require_tested("deepspeed", "zero_to_fp32._get_fp32_state_dict_from_zero{2,3}_checkpoint")
    from deepspeed.utils import zero_to_fp32

    model_states, stage, optimizer_states = _zero_checkpoint_files(folder, tensor_parallel_rank)
    masters = [state["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for state in optimizer_states]
    if key == "fp32":
        groups = masters
    else:
        groups = [[_base_optimizer_group_state(state, index)[key].narrow(0, 0, flat.numel()) for index, flat in enumerate(flats)]
                  for state, flats in zip(optimizer_states, masters)]
    dp_size = len(optimizer_states)
    if stage <= 2:
        return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
            dp_size, groups, model_states, False, optimizer_states[0].get("param_alignment_paddings"))
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(dp_size, groups, model_states, False)


def zero_checkpoint_step(folder: str, tensor_parallel_rank: int) -> int:
    """The optimizer step count of a ZeRO-1/2/3 checkpoint (its base optimizer's, group 0)."""
    require_tested("deepspeed", "the base optimizer state in ZeRO checkpoints")
    _, _, optimizer_states = _zero_checkpoint_files(folder, tensor_parallel_rank)
    return int(_base_optimizer_group_state(optimizer_states[0], 0)["step"])


def _zero_checkpoint_files(folder: str, tensor_parallel_rank: int):
    """(model states as zero_to_fp32 parses them, ZeRO stage, each data-parallel rank's optimizer
    state dict, memory-mapped)."""
    from deepspeed.utils import zero_to_fp32

    from metaseq_ds.distributed.safe_checkpoint_loading import safe_load

    pattern = f"mp_rank_{tensor_parallel_rank:02d}"
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_model_states.pt"))
    optimizer_states = [safe_load(path, map_location="cpu", mmap=True)["optimizer_state_dict"]
                        for path in zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_optim_states.pt")]
    return model_states, int(optimizer_states[0]["zero_stage"]), optimizer_states


def _base_optimizer_group_state(optimizer_state: Dict[str, Any], group: int) -> Dict[str, Any]:
    """The base (torch) optimizer's state of flat group `group`: ZeRO-3 saves the torch state dict
    ("optimizer_state_dict"), ZeRO-1/2 either that or, elastic, a list of per-group states."""
    if "fp32_flat_groups" in optimizer_state:
        return optimizer_state["optimizer_state_dict"]["state"][group]
    base = optimizer_state["base_optimizer_state"]
    return base[group] if isinstance(base, list) else base["state"][group]


def link_optimizer_state_fragments(zero_optimizer) -> None:
    """Make DeepSpeed's per-parameter views of the optimizer state (what
    `safe_set_full_optimizer_state` writes through) point at the base optimizer's state tensors.
    ZeRO-1/2 and the bf16 optimizer link them lazily at their first step; ZeRO-3 needs nothing."""
    require_tested("deepspeed", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state")
    link = getattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        zero_optimizer._hp_optimizer_states_linked = False
        link()


def unfused_fp32_masters(optimizer) -> Dict[int, Any]:
    """{id(model parameter): its fp32 master} of DeepSpeed's fp16/bf16 optimizer at ZeRO-0
    (`FP16_UnfusedOptimizer`), empty for any other optimizer. That wrapper keeps one fp32 copy per
    parameter, `fp32_groups[i][j]` for `fp16_groups[i][j]`, and the base optimizer steps the copies."""
    require_tested("deepspeed", "FP16_UnfusedOptimizer.fp16_groups/fp32_groups")
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return {}
    return {id(param): master for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups)
            for param, master in zip(params, masters)}


def unfused_optimizer_construction_steps() -> int:
    """Steps the base optimizer of `FP16_UnfusedOptimizer` takes when it is built (one, on zero
    gradients, to create its state): its step count runs that far ahead of the updates."""
    require_tested("deepspeed", "FP16_UnfusedOptimizer.initialize_optimizer_states")
    return 1


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
