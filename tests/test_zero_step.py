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

from launch import env, tiny_zero_engine, tiny_zero_step


def run_steps(stage: int, lean: bool, bf16: bool) -> dict:
    from metaseq_ds.private_apis import deepspeed_optimizers as private_apis
    from metaseq_ds.optim.zero_step import lean_zero_step

    # ZeRO-3: sub-groups of at most 500 of the 1348 parameters, the first weight alone, then the
    # three others; gradient buckets of 500 elements, which that weight's 1024 overfill; a
    # clipping norm the gradients exceed, so the norm scales every update
    zero_config = {"stage": stage, "sub_group_size": 500, "reduce_bucket_size": 500}
    engine = tiny_zero_engine(zero_config, gradient_clipping=0.05, bf16=bf16)
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
    losses, norms = [], []
    for step in range(4):
        losses.append(tiny_zero_step(engine, step))
        norms.append(float(engine.get_global_grad_norm()))
    return {"applied": applied, "losses": losses, "norms": norms, "grads_in_buffer": grads_in_buffer,
            "norm_pieces": norm_pieces, "bucket_left": bucket_left}


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


if __name__ == "__main__":
    stage, bf16 = int(sys.argv[1]), bool(int(sys.argv[2]))
    print(json.dumps([run_steps(stage, lean=False, bf16=bf16), run_steps(stage, lean=True, bf16=bf16)]))


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
    engine = Engine()
    engine.device = torch.device(device)
    assert lean_zero_step(engine) and chosen == [pieces]
