"""One test per shim of `metaseq_ds.private_apis`: each fails when upstream changes the private
behaviour metaseq_ds relies on, or when the version check stops guarding it.

The DeepSpeed shims run in a child process (one rank: DeepSpeed needs a process group, which
the rest of the test session should not inherit).
"""

import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch
import torch.nn.functional as F

from launch import env
from metaseq_ds import private_apis
from metaseq_ds.errors import UsageError


def test_an_untested_version_stops_with_one_line_unless_allowed(monkeypatch):
    real_version = metadata.version
    monkeypatch.setattr(private_apis.metadata, "version", lambda name: "9.1.0" if name == "torch" else real_version(name))
    private_apis.require_tested.cache_clear()
    try:
        with pytest.raises(UsageError, match=r"torch's private torch\.ops\.x, verified with torch 2\.13\.x; "
                                             r"this is torch 9\.1\.0: .*METASEQ_DS_ALLOW_UNTESTED=1"):
            private_apis.require_tested("torch", "torch.ops.x")
        private_apis.require_tested.cache_clear()
        monkeypatch.setenv(private_apis.ALLOW_UNTESTED, "1")
        with pytest.warns(UserWarning, match="trying anyway"):
            private_apis.require_tested("torch", "torch.ops.x")
    finally:
        private_apis.require_tested.cache_clear()


def test_installed_versions_are_the_tested_ones():
    for package in private_apis.TESTED:
        private_apis.require_tested(package, "anything")


def test_onednn_linear_equals_f_linear_for_plain_and_transposed_weights():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 24, generator=generator)
    weight = torch.randn(16, 24, generator=generator)
    bias = torch.randn(16, generator=generator)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(private_apis.onednn_linear(x, weight, bias), expected, rtol=1e-5, atol=1e-5)
    stored_transposed = weight.t().contiguous().t()  # the decoding layout: an (out, in) view of (in, out)
    torch.testing.assert_close(private_apis.onednn_linear(x, stored_transposed), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_weights_only_allowed_globals_holds_torchs_tensor_rebuilders():
    allowed = private_apis.weights_only_allowed_globals()
    assert allowed["torch._utils._rebuild_tensor_v2"] is torch._utils._rebuild_tensor_v2
    assert "torch.FloatStorage" in allowed and "collections.OrderedDict" in allowed


def test_even_split_meta_splits_every_dimension_into_equal_parts():
    from deepspeed.module_inject.tp_shard import get_shard_size_list

    meta = private_apis.even_split_tp_meta()
    assert list(get_shard_size_list(48, 2, meta, "decoder.layers.0.self_attn.q_proj")) == [24, 24]
    assert list(get_shard_size_list(272, 4, meta, "decoder.output_projection")) == [68] * 4


def test_deepspeed_shims_in_a_one_rank_process(tmp_path):
    out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["groups"] == {"before": False, "after": True, "tp_size": 1}
    for stage in ("2", "3"):
        result = found[stage]
        assert result["loads_through_override"] > 0  # every file the engine read went through ours
        assert result["consolidated_equal"], f"ZeRO-{stage}: consolidated weights differ from the module's"
    assert found["3"]["partition_pairs"] == {"count": 1, "same_layout": True}


def _engine(stage: int):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    loss = engine(torch.randn(2, 8)).square().sum()
    engine.backward(loss)
    engine.step()
    return engine


def _check_stage(stage: int, folder: str) -> dict:
    from deepspeed import zero

    from metaseq_ds.distributed.safe_checkpoint_loading import safe_load

    engine = _engine(stage)
    result = {}
    if stage == 3:
        pairs = private_apis.zero3_flat_partitions(engine.optimizer)
        result["partition_pairs"] = {"count": len(pairs), "same_layout": all(
            (m.dtype, m.shape) == (p.dtype, p.shape) for m, p in pairs)}
    loads = []

    def counting_load(path, map_location=None):
        loads.append(path)
        return safe_load(path, map_location=map_location)

    private_apis.replace_checkpoint_loader(engine, counting_load)
    engine.save_checkpoint(folder, tag="t")
    engine.load_checkpoint(folder, tag="t")
    result["loads_through_override"] = len(loads)
    consolidated = private_apis.consolidate_zero_shards(f"{folder}/t", 0)
    params = dict(engine.module.named_parameters())
    with zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        result["consolidated_equal"] = sorted(consolidated) == sorted(params) and all(
            torch.equal(consolidated[name].contiguous().float(), value.detach().float()) for name, value in params.items())
    return result


if __name__ == "__main__":
    from metaseq_ds.distributed import utils as dist_utils

    dist_utils.init_distributed()
    found = {"groups": {"before": private_apis.tensor_parallel_groups_initialized()}}
    private_apis.init_tensor_parallel_groups(1)
    found["groups"].update(after=private_apis.tensor_parallel_groups_initialized(),
                           tp_size=dist_utils.get_tensor_model_parallel_world_size())
    for stage in (2, 3):
        found[str(stage)] = _check_stage(stage, f"{sys.argv[1]}/zero{stage}")
    print(json.dumps(found))
