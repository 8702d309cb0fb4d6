"""ZeRO-1/2/3 in fp32 keep no second copy of the parameters as master weights, and train the same.

The engine runs in a child process (one rank: DeepSpeed needs a process group, which the rest
of the test session should not inherit).
"""

import json
import subprocess
import sys

import pytest

from launch import env, tiny_zero_engine, tiny_zero_step


def run_steps(stage: int, share: bool) -> dict:
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    from metaseq_ds.private_apis import deepspeed_optimizers as private_apis
    from metaseq_ds.optim.fp32_master_weights import share_fp32_master_weights

    engine = tiny_zero_engine({"stage": stage})
    freed = share_fp32_master_weights(engine) if share else 0
    pairs = (private_apis.zero3_flat_partitions if stage == 3 else private_apis.zero12_flat_partitions)(engine.optimizer)
    shared = all(m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr() for m, p in pairs)
    losses = [tiny_zero_step(engine, step) for step in range(4)]
    # DeepSpeed's per-parameter view of the master weights (universal checkpoints, resharding)
    # still reads the values the model trains with
    master_views_current = stage == 3 or all(
        torch.equal(safe_get_full_fp32_param(p), p.detach()) for p in engine.module.parameters())
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    return {"losses": losses, "freed": freed, "shared": shared, "param_bytes": 4 * params,
            "master_views_current": master_views_current}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_master_weights_are_the_parameters_and_training_is_unchanged(stage):
    out = subprocess.run([sys.executable, __file__, str(stage)], capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plain, shared = json.loads(out.stdout.strip().splitlines()[-1])
    assert not plain["shared"] and shared["shared"]
    assert shared["freed"] >= shared["param_bytes"]  # one rank: the whole fp32 copy (ZeRO-1/2: with alignment)
    assert shared["losses"] == plain["losses"]
    assert shared["master_views_current"]


if __name__ == "__main__":
    stage = int(sys.argv[1])
    print(json.dumps([run_steps(stage, share=False), run_steps(stage, share=True)]))
