"""ZeRO's gradients and step without their transient copies (`optim.zero_step`): the gradient
norm taken over pieces is DeepSpeed's (ZeRO-1/2/3), ZeRO-3's optimizer reads the flat gradient
buffer in fp32 (a concatenated copy in bf16), ZeRO-3 reduces a full gradient bucket at once,
and training is the same, with clipping, over several ZeRO-3 sub-groups.

The engine runs in a child process (one rank: DeepSpeed needs a process group, which the rest
of the test session should not inherit).
"""

import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from launch import env, tiny_zero_engine, tiny_zero_step


class DeviceReads(TorchDispatchMode):
    """Counts the reads of the device made inside it (each a host sync on a GPU)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket is torch.ops.aten._local_scalar_dense
        return func(*args, **(kwargs or {}))


def run_steps(stage: int, lean: bool, bf16: bool) -> dict:
    from metaseq_ds.private_apis import deepspeed_optimizers as private_apis
    from metaseq_ds.optim.zero_step import lean_zero_step

    # ZeRO-3: sub-groups of at most 500 of the 1348 parameters, the first weight alone, then the
    # three others; gradient buckets of 500 elements, which that weight's 1024 overfill; a
    # clipping norm the gradients exceed, so the norm scales every update
    zero_config = {"stage": stage, "sub_group_size": 500, "reduce_bucket_size": 500}
    engine = tiny_zero_engine(zero_config, gradient_clipping=0.05, bf16=bf16, fused=True)  # fused: no reads of its own
    zero = engine.optimizer
    grads_in_buffer, norm_pieces = [], []
    inner_step, norm = zero.optimizer.step, zero.get_grad_norm_direct

    def recording_step(*args, **kwargs):  # what the optimizer reads as gradients
        buffer = private_apis.zero3_gradient_buffer(zero).untyped_storage().data_ptr()
        grads_in_buffer.extend(p.grad.untyped_storage().data_ptr() == buffer
                               for group in zero.optimizer.param_groups for p in group["params"])
        return inner_step(*args, **kwargs)

    def recording_norm(gradients, params, *args):  # what DeepSpeed's norm gets
        norm_pieces.append(len(gradients))
        return norm(gradients, params, *args)

    if stage == 3:
        zero.optimizer.step = recording_step
    zero.get_grad_norm_direct = recording_norm
    applied = lean and lean_zero_step(engine, norm_chunk_elements=100)  # the 1024-element weight in 11 pieces
    bucket_left = []  # elements a gradient bucket holds once each gradient has been handed to it
    if stage == 3:
        add_to_bucket = zero.reduce_independent_p_g_buckets_and_remove_grads

        def recording_add(param):
            add_to_bucket(param)
            bucket_left.append(max(bucket.elements for bucket in zero.ipg_buckets.values()))

        zero.reduce_independent_p_g_buckets_and_remove_grads = recording_add
    engine_step, step_reads = engine.step, []

    def counted_step(*args, **kwargs):
        with DeviceReads() as reads:
            engine_step(*args, **kwargs)
        step_reads.append(reads.count)

    engine.step = counted_step
    losses, norms = [], []
    for step in range(4):
        losses.append(tiny_zero_step(engine, step))
        norms.append(float(engine.get_global_grad_norm()))
    return {"applied": applied, "losses": losses, "norms": norms, "grads_in_buffer": grads_in_buffer,
            "norm_pieces": norm_pieces, "bucket_left": bucket_left, "step_reads": step_reads}


def run_pair(stage: int, bf16: bool):
    out = subprocess.run([sys.executable, __file__, str(stage), str(int(bf16))], capture_output=True, text=True,
                         env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_lean_zero3_step_trains_the_same_without_gradient_copies(bf16):
    plain, lean = run_pair(3, bf16)
    assert lean["applied"] and not plain["applied"]
    assert lean["losses"] == plain["losses"]
    assert lean["norms"] == pytest.approx(plain["norms"], rel=1e-12) and min(plain["norms"]) > 0.05  # clipped
    # per step, the norm of each sub-group: DeepSpeed's sees 1 and 3 gradients; ours the first
    # weight's 1024 elements in 11 pieces, then the other three (64 + 256 + 4: 1, 3 and 1 pieces)
    assert plain["norm_pieces"] == [1, 3] * 4 and lean["norm_pieces"] == [11, 5] * 4
    # fp32: the first sub-group, one tensor, is read in the buffer either way, the second is
    # DeepSpeed's copy or ours in place; bf16 needs both copies (the conversion to fp32)
    assert plain["grads_in_buffer"] == ([False, False] if bf16 else [True, False]) * 4
    assert lean["grads_in_buffer"] == ([False, False] if bf16 else [True, True]) * 4
    # four gradients a step; DeepSpeed holds the 1024-element one in its bucket until the end of
    # the backward, ours reduces it at once
    assert len(plain["bucket_left"]) == len(lean["bucket_left"]) == 16
    assert max(plain["bucket_left"]) == 1024 and max(lean["bucket_left"]) < 500


@pytest.mark.parametrize("stage", [1, 2])
def test_lean_zero12_step_takes_the_same_norms_over_pieces(stage):
    plain, lean = run_pair(stage, bf16=False)
    assert lean["applied"] and not plain["applied"]
    assert lean["losses"] == plain["losses"]
    assert lean["norms"] == pytest.approx(plain["norms"], rel=1e-12) and min(plain["norms"]) > 0.05  # clipped
    # one optimizer group: DeepSpeed's norm sees the four gradients, ours 11 + 1 + 3 + 1 pieces
    # (and whatever alignment padding ZeRO-1/2 adds, in both)
    assert len(plain["norm_pieces"]) == len(lean["norm_pieces"]) == 4
    assert all(ours - theirs == 12 for ours, theirs in zip(lean["norm_pieces"], plain["norm_pieces"]))
    # the step's check of the norm, then DeepSpeed's again for each optimizer group it clips (one here)
    assert plain["step_reads"] == [2] * 4 and lean["step_reads"] == [1] * 4


def run_zero0_steps(lean: bool, dtype: str) -> dict:
    """Five updates of ZeRO-0's fp16/bf16 optimizer wrapper (over torch's fused AdamW, which reads
    nothing), the third with an inf in a gradient; per update: the loss, the device reads of the
    step, whether it applied, the norm, the loss scale the gradients had; then the fp32 masters,
    and whether the parameters hold them."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.optim.zero_step import lean_zero_step
    from metaseq_ds.private_apis.deepspeed_optimizers import unfused_step_with_one_read

    if dtype == "bf16":  # through the engine, as the trainer builds it
        engine = tiny_zero_engine({"stage": 0}, gradient_clipping=0.05, bf16=True, fused=True)
        model, optimizer = engine.module, engine.optimizer
        applied = lean and lean_zero_step(engine)
        backward, step, was_applied = engine.backward, engine.step, engine.was_step_applied
        norm_of_update = engine.get_global_grad_norm
    else:  # DeepSpeed builds no fp16 engine on the CPU: its ZeRO-0 wrapper alone, with dynamic loss scaling
        dist_utils.init_distributed()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).half()
        base = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
        optimizer = FP16_UnfusedOptimizer(base, low_precision_dtype=torch.float16, dynamic_loss_scale=True,
                                          dynamic_loss_args={"init_scale": 2.0**8, "scale_window": 2,
                                                             "min_scale": 1.0}, clip_grad=0.05)
        applied = lean and unfused_step_with_one_read(optimizer)
        backward, step = optimizer.backward, optimizer.step
        was_applied, norm_of_update = lambda: not optimizer.overflow, lambda: optimizer._global_grad_norm
    updates = []
    for update in range(5):
        generator = torch.Generator().manual_seed(update)
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
        low = model[0].weight.dtype
        loss = torch.nn.functional.mse_loss(model(x.to(low)), y.to(low))
        backward(loss)
        if update == 2:
            model[2].weight.grad[0, 0] = float("inf")
        scale = optimizer.loss_scale_config.cur_scale  # what the gradients were scaled by
        with DeviceReads() as reads:
            step()
        updates.append([loss.item(), reads.count, bool(was_applied()), float(norm_of_update()), scale])
        if dtype == "fp16":
            optimizer.zero_grad()
    masters = [master for group in optimizer.fp32_groups for master in group]
    return {"applied": applied, "updates": updates, "masters": [master.flatten().tolist() for master in masters],
            "in_params": all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters))}


def run_zero0_all_reduce(bf16: bool, keep_all_reduce: bool) -> dict:
    """4 updates of a ZeRO-0 engine in one process after `lean_zero_step`, with DeepSpeed's
    all-reduce after each backward put back where `keep_all_reduce`: whether the lean step skipped
    it, how often it ran, the losses and the parameters."""
    from metaseq_ds.optim.zero_step import lean_zero_step

    engine = tiny_zero_engine({"stage": 0}, gradient_clipping=0.05, bf16=bf16, fused=True)
    applied = lean_zero_step(engine)
    skipped = engine.enable_backward_allreduce is False
    engine.enable_backward_allreduce = engine.enable_backward_allreduce or keep_all_reduce
    all_reduce, calls = engine.allreduce_gradients, []

    def counted_all_reduce(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    engine.allreduce_gradients = counted_all_reduce
    losses = [tiny_zero_step(engine, step) for step in range(4)]
    return {"applied": applied, "skipped": skipped, "all_reduces": len(calls), "losses": losses,
            "params": [p.float().flatten().tolist() for p in engine.module.parameters()]}


if __name__ == "__main__":
    if sys.argv[1] == "zero0":
        print(json.dumps([run_zero0_steps(lean, sys.argv[2]) for lean in (False, True)]))
    elif sys.argv[1] == "zero0-all-reduce":
        print(json.dumps([run_zero0_all_reduce(sys.argv[2] == "bf16", keep) for keep in (True, False)]))
    else:
        stage, bf16 = int(sys.argv[1]), bool(int(sys.argv[2]))
        print(json.dumps([run_steps(stage, lean=False, bf16=bf16), run_steps(stage, lean=True, bf16=bf16)]))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_lean_zero0_step_reads_the_device_once_and_trains_the_same(dtype):
    """ZeRO-0's fp16/bf16 step (DeepSpeed's FP16_UnfusedOptimizer) read the device once a
    parameter (4 here, ~390 at OPT-1.3b); the lean one reads it once, and steps the same: the
    same losses and masters, an inf gradient skips the update (fp16: the loss scale falls), and
    the clipping norm is the gradient's (fp16: DeepSpeed's was the loss-scaled one)."""
    out = subprocess.run([sys.executable, __file__, "zero0", dtype], capture_output=True, text=True, env=env(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plain, lean = json.loads(out.stdout.strip().splitlines()[-1])
    assert lean["applied"] and not plain["applied"]
    # DeepSpeed: a read per gradient (4) and 3 more; at the inf in the third gradient, 3 and 1
    assert [u[1] for u in plain["updates"]] == [4 + 3, 4 + 3, 3 + 1, 4 + 3, 4 + 3]
    assert [u[1] for u in lean["updates"]] == [1] * 5
    assert [u[2] for u in lean["updates"]] == [u[2] for u in plain["updates"]]
    assert not lean["updates"][2][2] and lean["updates"][3][2]  # the inf skipped its update only
    assert [u[4] for u in lean["updates"]] == [u[4] for u in plain["updates"]]  # the loss scale
    assert [u[0] for u in lean["updates"]] == pytest.approx([u[0] for u in plain["updates"]], rel=1e-3)
    for ours, theirs in zip(lean["masters"], plain["masters"]):
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    scales = [u[4] for u in plain["updates"]]
    applied_norms = [(u[3], t[3], scale) for u, t, scale in zip(lean["updates"], plain["updates"], scales) if u[2]]
    assert all(ours == pytest.approx(theirs / scale, rel=1e-5) and ours > 0.05 for ours, theirs, scale in applied_norms)
    assert lean["in_params"] and plain["in_params"]


@pytest.mark.parametrize("device, pieces", [("cpu", 2**20), ("cuda", 2**24)])
def test_the_norm_pieces_are_cache_sized_on_the_cpu_and_few_on_a_gpu(device, pieces, monkeypatch):
    """On a GPU each piece costs kernel launches: 1.3B parameters in 2**20-element pieces would be
    ~3,800 launches a step; in 2**24-element ones, ~240."""
    import torch

    from metaseq_ds.optim.zero_step import lean_zero_step
    from metaseq_ds.private_apis import deepspeed_optimizers

    class Engine:
        optimizer = object()

        def zero_optimization_stage(self):
            return 1

        def zero_cpu_offload(self):
            return False

    chosen = []
    monkeypatch.setattr(deepspeed_optimizers, "zero_gradient_norms_in_pieces", lambda optimizer, n: chosen.append(n))
    monkeypatch.setattr(deepspeed_optimizers, "zero12_clip_on_the_device", lambda optimizer: None)
    engine = Engine()
    engine.device = torch.device(device)
    assert lean_zero_step(engine) and chosen == [pieces]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero0_in_one_process_skips_the_all_reduce_and_trains_the_same(dtype):
    """ZeRO-0 all-reduced the gradients after each backward also in a one-process world (flattened
    into new buckets, reduced over the one process, copied back): the lean step skips it, and the
    losses and parameters are the same to the bit as with it."""
    out = subprocess.run([sys.executable, __file__, "zero0-all-reduce", dtype], capture_output=True, text=True,
                         env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    kept, skipped = json.loads(out.stdout.strip().splitlines()[-1])
    assert skipped["applied"] and skipped["skipped"] and skipped["all_reduces"] == 0
    assert kept["all_reduces"] == 4
    assert skipped["losses"] == kept["losses"] and skipped["params"] == kept["params"]
