"""`metaseq_ds.private_apis`: each recorded workaround names a test that exists, its upstream
canaries still hold, and its version gate works; then one test per shim, each failing when
upstream changes the private behaviour metaseq_ds relies on.

The DeepSpeed shims run in a child process (one rank: DeepSpeed needs a process group, which
the rest of the test session should not inherit).
"""

import ast
import importlib
import inspect
import json
import os
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from launch import env
from metaseq_ds import host_memory
from metaseq_ds.distributed import gloo_collectives
from metaseq_ds.errors import UsageError
from metaseq_ds.private_apis import deepspeed_checkpoints as checkpoints
from metaseq_ds.private_apis import deepspeed_comm as comm
from metaseq_ds.private_apis import deepspeed_optimizers as optimizers
from metaseq_ds.private_apis import deepspeed_tensor_parallel as tensor_parallel
from metaseq_ds.private_apis import torch_ops, verified

ROOT = Path(__file__).resolve().parents[1]
# Every module holding a shim or patch (imported above, so each has recorded its own).
MODULES = (torch_ops, tensor_parallel, comm, optimizers, checkpoints, host_memory, gloo_collectives)
RELIANCES = sorted(verified.RELIED_ON.values(), key=lambda reliance: reliance.name)


def test_every_public_function_of_a_shim_module_is_recorded():
    recorded = {reliance.name for reliance in RELIANCES}
    for module in MODULES:
        public = {f"{module.__name__}.{name}" for name, value in vars(module).items()
                  if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")}
        if module.__name__.startswith("metaseq_ds.private_apis."):
            assert public <= recorded, f"not under @relies_on: {sorted(public - recorded)}"
        assert public & recorded, module.__name__


@pytest.mark.parametrize("reliance", RELIANCES, ids=lambda reliance: reliance.name.rsplit(".", 1)[1])
def test_each_workaround_names_an_existing_test_and_says_why(reliance):
    path, test_name = reliance.test.split("::")
    tree = ast.parse((ROOT / path).read_text())
    assert test_name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, reliance.test
    assert reliance.why and reliance.written_for.count(".") == 1


@pytest.mark.parametrize("reliance", [r for r in RELIANCES if r.canaries], ids=lambda reliance: reliance.name.rsplit(".", 1)[1])
def test_upstream_still_shows_each_behaviour_worked_around(reliance):
    """A canary gone means upstream changed the code worked around: see whether the workaround can go."""
    for module, line in reliance.canaries:
        assert line in inspect.getsource(importlib.import_module(module)), (
            f"{module} no longer has {line!r}: {reliance.name} works around it ({reliance.why})")


def test_an_untested_version_stops_with_one_line_unless_allowed(monkeypatch):
    real_version = metadata.version
    monkeypatch.setattr(verified.metadata, "version", lambda name: "9.1.0" if name == "torch" else real_version(name))
    monkeypatch.delenv(verified.ALLOW_UNTESTED, raising=False)
    verified.require_tested.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"torch's private torch\.ops\.x, written for torch 2\.13\.x; "
                                             r"this is torch 9\.1\.0: .*METASEQ_DS_ALLOW_UNTESTED=1"):
            verified.require_tested("torch", "torch.ops.x", "2.13")
        verified.require_tested.cache_clear()
        with pytest.raises(UsageError, match="_get_allowed_globals"):  # the gate sits on each shim
            torch_ops.weights_only_allowed_globals()
        verified.require_tested.cache_clear()
        monkeypatch.setenv(verified.ALLOW_UNTESTED, "1")
        with pytest.warns(UserWarning, match="trying anyway"):
            verified.require_tested("torch", "torch.ops.x", "2.13")
    finally:
        verified.require_tested.cache_clear()


def test_on_an_untested_version_a_speed_up_runs_its_public_fallback_warned_once(monkeypatch):
    """oneDNN's linear and bf16 query have public equivalents: another torch (the GPU machine's is
    2.11) trains on them instead of stopping; ALLOW_UNTESTED still tries the private API. Another
    DeepSpeed keeps its own ZeRO-0 fp16/bf16 step and all-reduce, and its references at exit."""
    real_version = metadata.version
    faked = {"torch": "2.11.0", "deepspeed": "0.20.0"}
    monkeypatch.setattr(verified.metadata, "version", lambda name: faked.get(name) or real_version(name))
    monkeypatch.delenv(verified.ALLOW_UNTESTED, raising=False)
    fallbacks = {r.name.rsplit(".", 1)[1]: r.fallback for r in RELIANCES if r.fallback}
    assert fallbacks == {"onednn_linear": "F.linear (torch's public CPU linear: MKL, up to 2x slower than oneDNN on AMD CPUs)",
                         "cpu_has_bf16_matmul": "torch's CPU capability being AVX-512 (its highest; oneDNN's bf16 "
                                                "kernels need at least that)",
                         "unfused_step_with_one_read": "DeepSpeed's own ZeRO-0 fp16/bf16 step, left in place (a read "
                                                       "of the device per parameter)",
                         "skip_all_reduce_in_one_process": "DeepSpeed's all-reduce of the gradients after each backward, "
                                                           "left in place (a copy of them all)",
                         "drop_deepspeeds_references": "DeepSpeed's process-wide references, left in place (its "
                                                       "groups then go as the interpreter finalises)."}
    x, weight = torch.randn(40, 24), torch.randn(16, 24)
    verified.use_private.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"_linear_pointwise, written for torch 2\.13\.x; this is torch 2\.11\.0: "
                                             r"using F\.linear .* instead \(set METASEQ_DS_ALLOW_UNTESTED=1"):
            assert torch.equal(torch_ops.onednn_linear(x, weight), F.linear(x, weight))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once a process
            torch_ops.onednn_linear(x, weight)
        with pytest.warns(UserWarning, match="using torch's CPU capability being AVX-512"):
            assert torch_ops.cpu_has_bf16_matmul() == (torch.backends.cpu.get_cpu_capability() == "AVX512")
        with pytest.warns(UserWarning, match=r"this is deepspeed 0\.20\.0: using DeepSpeed's own ZeRO-0"):
            assert optimizers.unfused_step_with_one_read(object()) is False  # the optimizer left as it is
        with pytest.warns(UserWarning, match=r"this is deepspeed 0\.20\.0: using DeepSpeed's all-reduce"):
            assert optimizers.skip_all_reduce_in_one_process(object()) is False  # the engine left as it is
        with pytest.warns(UserWarning, match=r"this is deepspeed 0\.20\.0: using DeepSpeed's process-wide references"):
            from deepspeed.runtime.zero import parameter_offload

            parameter_offload.FWD_MODULE_STACK.append(kept := torch.nn.Linear(1, 1))
            try:
                assert comm.drop_deepspeeds_references() is None
                assert parameter_offload.FWD_MODULE_STACK[-1] is kept  # nothing dropped
            finally:
                parameter_offload.FWD_MODULE_STACK.remove(kept)
        verified.use_private.cache_clear()
        monkeypatch.setenv(verified.ALLOW_UNTESTED, "1")
        with pytest.warns(UserWarning, match="trying anyway"):
            assert torch_ops.onednn_linear(x, weight).shape == (40, 16)
    finally:
        verified.use_private.cache_clear()


def test_the_bf16_fallback_agrees_with_onednn_here():
    """The public guess (AVX-512) and oneDNN's own answer, on this machine."""
    assert torch_ops._avx512_capability() == torch_ops.cpu_has_bf16_matmul()


def test_installed_versions_are_the_ones_written_for():
    for reliance in RELIANCES:
        if reliance.private:
            verified.require_tested(reliance.package, reliance.what, reliance.written_for)


def test_onednn_linear_equals_f_linear_for_plain_and_transposed_weights():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 24, generator=generator)
    weight = torch.randn(16, 24, generator=generator)
    bias = torch.randn(16, generator=generator)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(torch_ops.onednn_linear(x, weight, bias), expected, rtol=1e-5, atol=1e-5)
    stored_transposed = weight.t().contiguous().t()  # the decoding layout: an (out, in) view of (in, out)
    torch.testing.assert_close(torch_ops.onednn_linear(x, stored_transposed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_bf16_matmul_support_says_whether_onednn_runs_a_bf16_linear():
    # Where torch says yes, oneDNN builds a bf16 linear; where it says no (an AVX2 CPU), it cannot.
    x, weight = torch.randn(40, 24).bfloat16(), torch.randn(16, 24).bfloat16()
    if torch_ops.cpu_has_bf16_matmul():
        torch.testing.assert_close(torch_ops.onednn_linear(x, weight), F.linear(x, weight), rtol=2e-2, atol=2e-2)
    else:
        with pytest.raises(RuntimeError, match="primitive descriptor"):
            torch_ops.onednn_linear(x, weight)


def test_weights_only_allowed_globals_holds_torchs_tensor_rebuilders():
    allowed = torch_ops.weights_only_allowed_globals()
    assert allowed["torch._utils._rebuild_tensor_v2"] is torch._utils._rebuild_tensor_v2
    assert "torch.FloatStorage" in allowed and "collections.OrderedDict" in allowed


def test_even_split_meta_splits_every_dimension_into_equal_parts():
    from deepspeed.module_inject.tp_shard import get_shard_size_list

    meta = tensor_parallel.even_split_tp_meta()
    assert list(get_shard_size_list(48, 2, meta, "decoder.layers.0.self_attn.q_proj")) == [24, 24]
    assert list(get_shard_size_list(272, 4, meta, "decoder.output_projection")) == [68] * 4


def test_cpu_ranks_count_local_ranks_without_starting_numactl(monkeypatch):
    """DeepSpeed's CPU accelerator runs `numactl --hardware` at each device_count() unless LOCAL_SIZE is
    set (ZeRO-3 asks once a gradient bucket); our rendezvous' LOCAL_WORLD_SIZE sets it, a launcher's stays."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    started = []

    def numactl(command, *args, **kwargs):
        started.append(command)
        return b"available: 1 nodes (0)\nnode 0 cpus: 0 1\n"

    monkeypatch.setattr(subprocess, "check_output", numactl)
    for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so that the test's values are undone after it
        monkeypatch.delenv(name)
    assert CPU_Accelerator().device_count() == 1 and started == [["numactl", "--hardware"]]  # upstream, unset
    comm.count_local_ranks_without_numactl()
    assert "LOCAL_SIZE" not in os.environ  # nothing to count from
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    comm.count_local_ranks_without_numactl()
    assert CPU_Accelerator().device_count() == 3 and len(started) == 1
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launcher set it: kept
    comm.count_local_ranks_without_numactl()
    assert os.environ["LOCAL_SIZE"] == "2"


def test_deepspeed_shims_in_a_one_rank_process(tmp_path):
    # LOCAL_SIZE (set by the deepspeed launcher) = world size: DeepSpeed's shm all-reduce op starts up.
    out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True,
                         env={**env(), "LOCAL_SIZE": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["shm"] == {"created_as_named": True, "released": True}
    assert found["groups"] == {"before": False, "after": True, "tp_size": 1}
    for stage in ("2", "3"):
        result = found[stage]
        assert result["loads_through_override"] > 0  # every file the engine read went through ours
        assert result["consolidated_equal"], f"ZeRO-{stage}: consolidated weights differ from the module's"
        assert result["moments_equal"], f"ZeRO-{stage}: consolidated Adam moments differ from DeepSpeed's own"
        assert result["step"] == 1
        assert result["linked_then_set"], f"ZeRO-{stage}: a moment set before the first step did not land"
    assert found["3"]["partition_pairs"] == {"count": 1, "same_layout": True}
    assert found["3"]["partition_starts"] == [0, True]
    # ZeRO-0 in bf16: an fp32 copy of each of the 4 parameters, and one step taken at construction.
    assert found["unfused"] == {"copies": 4, "fp32": True, "base_step": 1, "construction_steps": 1}


def _engine(stage: int, steps: int = 1, bf16: bool = False):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    for _ in range(steps):
        loss = engine(torch.randn(2, 8)).square().sum()
        engine.backward(loss)
        engine.step()
    return engine, optimizer


def _check_unfused() -> dict:
    engine, base = _engine(0, steps=0, bf16=True)
    copies = optimizers.unfused_fp32_masters(engine.optimizer)
    return {"copies": len(copies), "fp32": all(master.dtype == torch.float32 for master in copies.values()),
            "base_step": int(next(iter(base.state.values()))["step"]),
            "construction_steps": optimizers.unfused_optimizer_construction_steps()}


def _linked_then_set(stage: int) -> bool:
    """A fresh engine (no step yet): create Adam's state, link it, set a moment through DeepSpeed."""
    from deepspeed.utils import safe_get_full_optimizer_state, safe_set_full_optimizer_state

    engine, base = _engine(stage, steps=0)
    stepped = ([master for master, _ in optimizers.zero3_flat_partitions(engine.optimizer)] if stage == 3
               else [flat for group in base.param_groups for flat in group["params"]])
    for flat in stepped:
        base.state[flat] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(flat), "exp_avg_sq": torch.zeros_like(flat)}
    optimizers.link_optimizer_state_fragments(engine.optimizer)
    param = next(engine.module.parameters())
    value = torch.arange(float(param.ds_numel if stage == 3 else param.numel())).view(
        param.ds_shape if stage == 3 else param.shape)
    safe_set_full_optimizer_state(param, value, "exp_avg")
    return torch.equal(safe_get_full_optimizer_state(param, "exp_avg"), value)


def _check_stage(stage: int, folder: str) -> dict:
    from deepspeed import zero

    from metaseq_ds.checkpoint.safe_loading import safe_load

    from deepspeed.utils import safe_get_full_optimizer_state

    engine, _ = _engine(stage)
    result = {}
    if stage == 3:
        pairs = optimizers.zero3_flat_partitions(engine.optimizer)
        result["partition_pairs"] = {"count": len(pairs), "same_layout": all(
            (m.dtype, m.shape) == (p.dtype, p.shape) for m, p in pairs)}
        first = next(engine.module.parameters())  # one rank: its partition is the whole (padded) parameter
        result["partition_starts"] = [optimizers.zero3_partition_start(first, 0),
                                      optimizers.zero3_partition_start(first, 1) >= first.ds_numel]
    loads = []

    def counting_load(path, map_location=None):
        loads.append(path)
        return safe_load(path, map_location=map_location)

    checkpoints.replace_checkpoint_loader(engine, counting_load)
    engine.save_checkpoint(folder, tag="t")
    engine.load_checkpoint(folder, tag="t")
    result["loads_through_override"] = len(loads)
    consolidated = checkpoints.consolidate_zero_shards(f"{folder}/t", 0)
    params = dict(engine.module.named_parameters())
    with zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        result["consolidated_equal"] = sorted(consolidated) == sorted(params) and all(
            torch.equal(consolidated[name].contiguous().float(), value.detach().float()) for name, value in params.items())
    moments = checkpoints.zero_checkpoint_values(f"{folder}/t", 0, "exp_avg", safe_load)
    optimizers.link_optimizer_state_fragments(engine.optimizer)  # load_checkpoint unlinked them
    result["moments_equal"] = all(torch.equal(moments[name].contiguous(), safe_get_full_optimizer_state(value, "exp_avg"))
                                  for name, value in params.items())
    result["step"] = checkpoints.zero_checkpoint_step(f"{folder}/t", 0, safe_load)
    result["linked_then_set"] = _linked_then_set(stage)
    return result


if __name__ == "__main__":
    from metaseq_ds.distributed import utils as dist_utils

    dist_utils.prepare_environment()
    dist_utils.start_process_group()  # dist_utils.init_distributed's steps, with a look at /dev/shm in between
    buffer = comm.shm_allreduce_buffer(0)
    found = {"shm": {"created_as_named": buffer.is_file()}}
    dist_utils.release_shm_buffer()
    found["shm"]["released"] = not buffer.exists()
    found["groups"] = {"before": tensor_parallel.tensor_parallel_groups_initialized()}
    tensor_parallel.init_tensor_parallel_groups(1)
    found["groups"].update(after=tensor_parallel.tensor_parallel_groups_initialized(),
                           tp_size=dist_utils.get_tensor_model_parallel_world_size())
    for stage in (2, 3):
        found[str(stage)] = _check_stage(stage, f"{sys.argv[1]}/zero{stage}")
    found["unfused"] = _check_unfused()
    print(json.dumps(found))
