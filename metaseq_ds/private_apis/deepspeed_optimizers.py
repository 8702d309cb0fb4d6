"""DeepSpeed's ZeRO-1/2/3 optimizers, its fp16/bf16 optimizer wrapper and ZeRO-0's gradient
all-reduce (deepspeed 0.19): the flat partitions they step, the patches that keep their steps
free of whole-gradient copies (`optim.zero_step`, `optim.fp32_master_weights`,
`distributed.tied_embedding`), and ZeRO-3's parameter persistence on one data-parallel rank
(`distributed.deepspeed_config`)."""

import sys
from typing import Any, Dict, List, Tuple

from metaseq_ds.private_apis.verified import relies_on


@relies_on("deepspeed", "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat",
           written_for="0.19", cuda=True,
           why="fp32 training shares the master partitions with the parameter partitions (optim.fp32_master_weights):"
               " ZeRO-3's own reuse (https://github.com/deepspeedai/DeepSpeed/pull/7651) compares a torch.device with"
               " a device name, never equal, and clones anyway; resharding sets Adam's state on them",
           test="tests/test_fp32_master_weights.py::test_fp32_master_weights_are_the_parameters_and_training_is_unchanged",
           canaries=(("deepspeed.runtime.zero.stage3", "self.fp16_partitioned_groups_flat[i].device == self.device"),))
def zero3_flat_partitions(zero_optimizer) -> List[Tuple[Any, Any]]:
    """(fp32 master partition, training-dtype parameter partition) per parameter group of a
    ZeRO-3 optimizer: the flat buffers DeepSpeed steps and copies between."""
    return list(zip(zero_optimizer.fp32_partitioned_groups_flat, zero_optimizer.fp16_partitioned_groups_flat))


@relies_on("deepspeed", "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups",
           written_for="0.19", cuda=True,
           why="ZeRO-1/2 always clone fp32 parameters as master weights (stage_1_and_2.py; 'redundant data copies', "
               "https://github.com/deepspeedai/DeepSpeed/issues/109): 4 bytes a parameter more than needed in fp32 "
               "training",
           test="tests/test_fp32_master_weights.py::test_fp32_master_weights_are_the_parameters_and_training_is_unchanged",
           canaries=(("deepspeed.runtime.zero.stage_1_and_2", "self.parallel_partitioned_bit16_groups[i][partition_id].detach().clone()"),))
def zero12_flat_partitions(zero_optimizer) -> List[Tuple[Any, Any]]:
    """(fp32 master partition, training-dtype parameter partition) per parameter group of a
    ZeRO-1/2 optimizer: the flat buffers DeepSpeed steps and copies between."""
    return [(master, zero_optimizer.parallel_partitioned_bit16_groups[i][_zero12_partition_id(zero_optimizer, i)])
            for i, master in enumerate(zero_optimizer.single_partition_of_fp32_groups)]


def _zero12_partition_id(zero_optimizer, group: int) -> int:
    import deepspeed.comm as dist

    return dist.get_rank(group=zero_optimizer.real_dp_process_group[group])


@relies_on("deepspeed", "DeepSpeedZeroOptimizer._link_all_hp_params",
           written_for="0.19", cuda=True,
           why="after the master partitions share the parameters' storage, DeepSpeed's per-parameter fp32 fragments "
               "must be views of the new storage",
           test="tests/test_fp32_master_weights.py::test_fp32_master_weights_are_the_parameters_and_training_is_unchanged")
def relink_zero12_master_fragments(zero_optimizer) -> None:
    """After a ZeRO-1/2 master partition got new storage: each parameter's view of its fp32
    fragment (`param._hp_mapping`, what `safe_get_full_fp32_param` and universal checkpoints
    read) was a view of the old storage; DeepSpeed's own linking makes them again, and the
    optimizer-state fragments are linked afresh at the first step."""
    zero_optimizer._link_all_hp_params()
    zero_optimizer._hp_optimizer_states_linked = False


@relies_on("deepspeed", "ZeRO-3's contiguous partitions of a flattened parameter (ds_tensor)",
           written_for="0.19", cuda=True,
           why="the streamed tied embedding reads and writes its rows of the weight's partitions itself",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def zero3_partition_start(param, group_rank: int) -> int:
    """Where rank `group_rank`'s partition of a ZeRO-3 parameter starts in the flattened parameter.
    ZeRO-3 cuts the flattened parameter (padded at its end) into equal contiguous partitions, rank
    r of its group holding elements [r * n, (r + 1) * n) for n = the partition's size; the
    gradient partitions follow the same layout. (Checked on 2 ranks: tests/test_tied_embedding.py.)"""
    return group_rank * param.ds_tensor.ds_numel


@relies_on("deepspeed", "DeepSpeedZeRoOffload's forward_hooks and backward_hooks handles",
           written_for="0.19", cuda=True,
           why="ZeRO-3 would gather the tied embedding whole (412 MB at 707M) before its forward and backward; the "
               "streamed embedding reads partitions instead. No public way to exempt a module",
           test="tests/test_tied_embedding.py::test_zero3_losses_and_gradients_with_the_streamed_tied_embedding_equal_plain_autograd")
def stop_zero3_gathering(engine, modules) -> None:
    """Remove the hooks ZeRO-3 registered on each of `modules` (not their children), so it never
    gathers their own parameters: not before their forward, nor before their backward. Whoever
    calls this reads those parameters' partitions itself. DeepSpeedZeRoOffload keeps the handles
    of the four hooks it puts on every module (`forward_hooks`, `backward_hooks`); each is removed
    from its module's hook dict. (Checked on 2 ranks by tests/test_tied_embedding.py: the tied
    weight is never gathered.)"""
    offload = engine.optimizer.parameter_offload
    hook_dicts = {id(hooks) for module in modules for hooks in (module._forward_pre_hooks, module._forward_hooks)}
    for handle in offload.forward_hooks + offload.backward_hooks:
        if id(handle.hooks_dict_ref()) in hook_dicts:
            handle.remove()


@relies_on("deepspeed", "the ZeRO optimizers' get_grad_norm_direct(gradients, params) and _zero_padding",
           written_for="0.19", cuda=True,
           why="get_grad_norm_direct copies each whole gradient partition to fp64 (g.to(get_norm_dtype())): a "
               "transient of twice the largest fp32 partition, on the GPU too; no upstream issue found; goes when "
               "DeepSpeed's norm accumulates in pieces",
           test="tests/test_zero_step.py::test_lean_zero12_step_takes_the_same_norms_over_pieces",
           canaries=(("deepspeed.runtime.zero.stage_1_and_2", "g.data.to(get_norm_dtype())"), ("deepspeed.runtime.zero.stage3", ".to(get_norm_dtype()).norm(norm_type)")))
def zero_gradient_norms_in_pieces(zero_optimizer, piece_elements: int) -> None:
    """Make a ZeRO-1/2/3 optimizer's gradient norm (`get_grad_norm_direct(gradients, params)`,
    which copies each gradient to fp64 whole) see gradients of more than `piece_elements` as
    consecutive pieces, each paired with its parameter: the same norm, in fp64, with a transient
    of one piece. ZeRO-1/2's padding tensors (`_zero_padding`, which its norm skips and pairs with
    no parameter) pass as they are. (Checked by tests/test_zero_step.py: the same norms and
    losses, the pieces reach DeepSpeed's norm.)"""
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


@relies_on("deepspeed", "DeepSpeedZeroOptimizer.unscale_and_clip_grads(grad_groups_flat, total_norm), loss_scale, "
           "clip_grad", written_for="0.19", cuda=True,
           why="ZeRO-1/2's step reads again, for each optimizer group it clips, whether the global norm it has "
               "already checked is valid (is_invalid_grad_norm: a host sync a group, ~26 a step at OPT-1.3b in "
               "groups of about a layer, each one stalling the GPU between groups); no upstream issue found",
           test="tests/test_zero_step.py::test_lean_zero12_step_takes_the_same_norms_over_pieces",
           canaries=(("deepspeed.runtime.zero.stage_1_and_2", "if is_invalid_grad_norm(clip_norm):"),))
def zero12_clip_on_the_device(zero_optimizer) -> None:
    """Make ZeRO-1/2's `unscale_and_clip_grads` decide on the device what it read from it: an
    invalid norm (not finite, or DeepSpeed's negative sentinel) clips as an infinite one, by
    `torch.where`, and the rest is DeepSpeed's arithmetic, op for op (the same scaled gradients).
    (Checked by tests/test_zero_step.py: the same losses and norms, one read a step fewer a group.)"""
    import torch

    def unscale_and_clip_grads(grad_groups_flat, total_norm) -> None:
        if zero_optimizer.clip_grad == 0.0 and zero_optimizer.loss_scale == 1.0:
            return
        combined_scale = zero_optimizer.loss_scale
        if zero_optimizer.clip_grad > 0.0:
            total_norm = torch.as_tensor(total_norm, dtype=torch.float, device=zero_optimizer.device)
            clip_norm = torch.where(torch.isfinite(total_norm) & (total_norm >= 0), total_norm, float("inf"))
            clip = ((clip_norm / zero_optimizer.loss_scale) + 1e-6) / zero_optimizer.clip_grad  # the norm is norm * scale
            combined_scale = torch.clamp(clip, min=1.0) * zero_optimizer.loss_scale
        for grad in grad_groups_flat:
            for part in grad if isinstance(grad, list) else (grad,):
                part.data.mul_(1.0 / combined_scale)

    zero_optimizer.unscale_and_clip_grads = unscale_and_clip_grads


@relies_on("deepspeed", "DeepSpeedZeroOptimizer_Stage3's ipg_buckets and __reduce_and_partition_ipg_grads",
           written_for="0.19", cuda=True,
           why="ZeRO-3 learns a bucket is full only when the next gradient would not fit, so a gradient larger than "
               "the bucket stays whole through the next module's backward",
           test="tests/test_zero_step.py::test_lean_zero3_step_trains_the_same_without_gradient_copies",
           canaries=(("deepspeed.runtime.zero.stage3", "bucket.elements + param.ds_numel > self.reduce_bucket_size"),))
def zero3_reduce_full_buckets_at_once(zero_optimizer) -> None:
    """Make ZeRO-3 reduce-scatter a gradient bucket as soon as it holds `reduce_bucket_size`
    elements. DeepSpeed learns that a bucket is full only when the next gradient would not fit
    (`reduce_independent_p_g_buckets_and_remove_grads`), so a gradient larger than the bucket,
    which is reduced on its own anyway, is held whole until the next module's backward has made
    its own gradient: at 707M with TP=2, fc2's 33 MB gradient beside fc1's gathered weight and
    fc1's gradient. Reducing it at once issues the same collectives in the same order, one
    gradient earlier (on a GPU, on ZeRO's reduce stream). (Checked by tests/test_zero_step.py:
    the same losses, no gradient bucket left full.)"""
    add_to_bucket = zero_optimizer.reduce_independent_p_g_buckets_and_remove_grads
    reduce_bucket = zero_optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads

    def add_and_reduce_when_full(param) -> None:
        add_to_bucket(param)
        comm_dtype = zero_optimizer.get_param_comm_dtype(param)
        if zero_optimizer.ipg_buckets[comm_dtype].elements >= zero_optimizer.reduce_bucket_size:
            reduce_bucket(comm_dtype)

    zero_optimizer.reduce_independent_p_g_buckets_and_remove_grads = add_and_reduce_when_full


@relies_on("deepspeed", "DeepSpeedZeroOptimizer_Stage3._prepare_fp32_grad_for_sub_group and averaged_gradients",
           written_for="0.19", cuda=True,
           why="ZeRO-3 concatenates a sub-group's fp32 gradients, already adjacent in its flat buffer, into a new "
               "tensor (up to 200 MB at width 2048) before the step",
           test="tests/test_zero_step.py::test_lean_zero3_step_trains_the_same_without_gradient_copies",
           canaries=(("deepspeed.runtime.zero.stage3", "self.flatten(self.averaged_gradients[sub_group_id])"),))
def zero3_step_on_the_gradient_buffer(zero_optimizer) -> None:
    """Make ZeRO-3's step give each optimizer sub-group, as its fp32 gradient, the span of the flat
    gradient buffer its gradients already lie in, where `_prepare_fp32_grad_for_sub_group`
    concatenates them into a new tensor (`self.flatten(averaged_gradients[i]).to(fp32)`): in fp32
    training that is a copy of up to a sub-group (12 d*d elements: 200 MB at width 2048) on top
    of the step. Sub-groups whose gradients are not adjacent fp32 spans of that buffer (bf16, fp16
    training) keep DeepSpeed's copy. The buffer is then unscaled and clipped in place; ZeRO-3
    overwrites it at the next update's first micro-step. (Checked by tests/test_zero_step.py: the
    same losses, the optimizer reads the buffer.)"""
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


@relies_on("deepspeed", "DeepSpeedZeroOptimizer_Stage3.grad_partitions_flat_buffer",
           written_for="0.19", cuda=True,
           why="memory figures and the lean step read the flat gradient buffer, which has no public accessor",
           test="tests/test_zero_step.py::test_lean_zero3_step_trains_the_same_without_gradient_copies")
def zero3_gradient_buffer(zero_optimizer):
    """The flat buffer a ZeRO-3 optimizer keeps this rank's gradient partitions in (memory figures)."""
    return zero_optimizer.grad_partitions_flat_buffer


@relies_on("deepspeed", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
           written_for="0.19", cuda=True,
           why="resharding sets Adam's moments before the first step; ZeRO-1/2 and the bf16 optimizer link their "
               "per-parameter state views only at that step (https://github.com/deepspeedai/DeepSpeed/pull/5104, "
               "open)",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def link_optimizer_state_fragments(zero_optimizer) -> None:
    """Make DeepSpeed's per-parameter views of the optimizer state (what
    `safe_set_full_optimizer_state` writes through) point at the base optimizer's state tensors.
    ZeRO-1/2 and the bf16 optimizer link them lazily at their first step; ZeRO-3 needs nothing."""
    link = getattr(zero_optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        zero_optimizer._hp_optimizer_states_linked = False
        link()


@relies_on("deepspeed", "FP16_UnfusedOptimizer.fp16_groups/fp32_groups",
           written_for="0.19", cuda=True,
           why="ZeRO-0 in bf16 keeps an fp32 copy per parameter, which resharding reads and writes; no public "
               "accessor",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def unfused_fp32_masters(optimizer) -> Dict[int, Any]:
    """{id(model parameter): its fp32 master} of DeepSpeed's fp16/bf16 optimizer at ZeRO-0
    (`FP16_UnfusedOptimizer`), empty for any other optimizer. That wrapper keeps one fp32 copy per
    parameter, `fp32_groups[i][j]` for `fp16_groups[i][j]`, and the base optimizer steps the copies."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return {}
    return {id(param): master for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups)
            for param, master in zip(params, masters)}


@relies_on("deepspeed", "FP16_UnfusedOptimizer.initialize_optimizer_states",
           written_for="0.19", cuda=True,
           why="that optimizer takes one step on zero gradients when built, so its step count runs one ahead of the "
               "updates (https://github.com/deepspeedai/DeepSpeed/pull/5104, open)",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def unfused_optimizer_construction_steps() -> int:
    """Steps the base optimizer of `FP16_UnfusedOptimizer` takes when it is built (one, on zero
    gradients, to create its state): its step count runs that far ahead of the updates."""
    return 1


def _keep_deepspeeds_unfused_step(optimizer) -> bool:
    """DeepSpeed's own ZeRO-0 fp16/bf16 step, left in place (a read of the device per parameter)"""
    return False


@relies_on("deepspeed", "FP16_UnfusedOptimizer's step and state (fp16_groups, fp32_groups, loss_scale_config, "
           "_update_scale, _skip_invalid_grad_norm)",
           written_for="0.19", cuda=True,
           why="ZeRO-0's fp16/bf16 step asks each gradient in turn whether it holds an inf or NaN, a read of the "
               "device each (CheckOverflow.has_overflow_serial), then takes each norm from a fresh fp32 copy: at "
               "OPT-1.3b ~390 host syncs and ~5,000 kernels a step on a GPU; no upstream issue found; goes when "
               "DeepSpeed decides overflow from one norm",
           test="tests/test_zero_step.py::test_lean_zero0_step_reads_the_device_once_and_trains_the_same",
           canaries=(("deepspeed.runtime.utils", "if p.grad is not None and self._has_inf_or_nan(p.grad.data, i):"),
                     ("deepspeed.runtime.fp16.unfused_optimizer", "self.overflow = self.overflow_checker.check()")),
           fallback=_keep_deepspeeds_unfused_step)
def unfused_step_with_one_read(optimizer) -> bool:
    """Make DeepSpeed's ZeRO-0 fp16/bf16 step (`FP16_UnfusedOptimizer.step`) read the device once:
    the gradients, converted to fp32 and unscaled, give one norm (torch's multi-tensor norm), whose
    finiteness is the one read and decides what DeepSpeed decided gradient by gradient (a skipped
    step: loss scale lowered, gradients dropped) and from its norm (an infinite norm skips too);
    clipping scales by that norm on the device. Same step otherwise: the base optimizer steps the
    fp32 masters, which are copied into the parameters. The norm DeepSpeed reports is then a 0-dim
    device tensor of the unscaled gradient (DeepSpeed's was the loss-scaled one in fp16, a number).
    Returns whether the step was replaced: not for another wrapper, tensor or expert parallelism
    (whose norms and overflow DeepSpeed reduces over their groups), an external loss scale or fused LAMB.
    (Checked by tests/test_zero_step.py: the same masters and losses, overflow included, one read.)"""
    import torch
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):  # DeepSpeed's FusedAdam gets its flat FP16_Optimizer
        return False
    engine = optimizer.overflow_checker.deepspeed
    if (optimizer.mpu is not None or optimizer.overflow_checker.has_moe_params or optimizer.custom_loss_scaler
            or optimizer.fused_lamb_legacy or (engine is not None and engine.enable_backward_allreduce is False)):
        return False  # DeepSpeed's overflow check then reduces over a group: its step stays

    def step(closure=None):
        params = [param for group in optimizer.fp16_groups for param in group]
        masters = [master for group in optimizer.fp32_groups for master in group]
        unscale = 1.0 / optimizer.loss_scale_config.cur_scale
        for master, param in zip(masters, params):
            master.grad = torch.zeros_like(master) if param.grad is None else param.grad.to(master.dtype)
            if unscale != 1.0:
                master.grad.mul_(unscale)
        norm = torch.nn.utils.get_total_norm([master.grad for master in masters], norm_type=2.0)
        if not torch.isfinite(norm):  # the step's one read of the device
            return optimizer._skip_invalid_grad_norm()
        optimizer.overflow = False
        optimizer._global_grad_norm = norm
        optimizer._update_scale(False)
        if optimizer.clip_grad > 0:
            torch.nn.utils.clip_grads_with_norm_(masters, optimizer.clip_grad, norm)
        optimizer.optimizer.step()
        for master, param in zip(masters, params):
            master.grad = None
            param.data.copy_(master.data)
        return False

    optimizer.step = step
    return True


def _keep_deepspeeds_all_reduce(engine) -> bool:
    """DeepSpeed's all-reduce of the gradients after each backward, left in place (a copy of them all)"""
    return False


@relies_on("deepspeed", "DeepSpeedEngine.enable_backward_allreduce",
           written_for="0.19", cuda=True,
           why="ZeRO-0's backward all-reduces the gradients over the data-parallel group even when it is one "
               "process: it flattens them into new buckets of up to 5e8 elements, all-reduces those and copies "
               "them back (42 ms of a 3 s bf16 step of the CPU benchmark, 95 ms in fp32; a 1 GB transient and "
               "four passes over 2.6 GB at OPT-1.3b on one GPU); DeepSpeed turns it off only without a "
               "communication backend; no upstream issue found (the like for ZeRO-1/2's model-parallel all-reduce of "
               "one: https://github.com/deepspeedai/DeepSpeed/pull/2494)",
           test="tests/test_zero_step.py::test_zero0_in_one_process_skips_the_all_reduce_and_trains_the_same",
           canaries=(("deepspeed.runtime.engine", "if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:"),),
           fallback=_keep_deepspeeds_all_reduce)
def skip_all_reduce_in_one_process(engine) -> bool:
    """Make a ZeRO-0 engine of a one-process world skip the all-reduce of the gradients after each
    backward (`DeepSpeedEngine.allreduce_gradients`), which over one process leaves them as they
    were (the average of one); whether it was skipped. Not with more processes, nor with MoE
    layers (whose expert groups DeepSpeed reduces in the same call). Call it after
    `unfused_step_with_one_read`, which keeps DeepSpeed's step for an engine that does not reduce."""
    import deepspeed.comm as dist

    if engine.zero_optimization_stage() != 0 or engine.has_moe_layers or dist.get_world_size() != 1:
        return False
    engine.enable_backward_allreduce = False
    return True


@relies_on("deepspeed", "ZeRO-3's gather over a group of one rank (_no_gather_coalesced): a view of the partition, "
                        "whose wait synchronizes the device's stream",
           written_for="0.19", cuda=True, private=False,
           why="with one data-parallel rank ZeRO-3 'gathers' a module's parameters as views of their partitions, and "
               "each wait (NoGatherHandle, NoGatherCoalescedHandle) synchronizes the current CUDA stream: a host stall "
               "at every module's fetch, forward and backward (292 a step at 24 layers), which ends the host's run-ahead "
               "each time. Persistent parameters are fetched once after each step instead; on one rank they are "
               "those same views, so no memory is added",
           test="tests/test_zero3_one_rank.py::test_one_rank_zero3_persists_every_parameter_as_views_and_trains_the_same",
           canaries=(("deepspeed.runtime.zero.partition_parameters", "get_accelerator().current_stream().synchronize()"),
                     ("deepspeed.runtime.zero.partition_parameters", "return _no_gather_coalesced(params)")))
def one_rank_persistence_threshold() -> int:
    """`stage3_param_persistence_threshold` for ZeRO-3 on one data-parallel rank: every parameter
    persists (DeepSpeed's own unbounded default of the model-wide limit, `sys.maxsize`)."""
    return sys.maxsize
