"""ZeRO-3 on one data-parallel rank: every parameter persists, so no module's fetch waits on the
device (`private_apis.deepspeed_optimizers.one_rank_persistence_threshold`), the persistent
parameters are views of their partitions (no memory added), and training is unchanged.

The engines run in a child process (one rank: DeepSpeed needs a process group, which the rest of
the test session should not inherit).
"""

import json
import subprocess
import sys

from launch import env, tiny_zero_engine, tiny_zero_step

STEPS = 4


def run_steps(threshold: int) -> dict:
    from deepspeed.runtime.zero import partition_parameters

    waits = []
    for handle in (partition_parameters.NoGatherHandle, partition_parameters.NoGatherCoalescedHandle):
        # On a GPU each of these waits synchronizes the current stream (the CPU's resolves data dependencies).
        original = handle.wait
        handle.wait = lambda self, *args, _original=original, **kwargs: (waits.append(1), _original(self, *args, **kwargs))[1]
    engine = tiny_zero_engine({"stage": 3, "stage3_param_persistence_threshold": threshold})
    losses = [tiny_zero_step(engine, 0)]
    before = len(waits)  # after the first step, which also traces the modules' order
    losses += [tiny_zero_step(engine, step) for step in range(1, STEPS)]
    params = list(engine.module.parameters())
    views = all(p.data.untyped_storage().data_ptr() == p.ds_tensor.untyped_storage().data_ptr() for p in params)
    return {"losses": losses, "waits_per_step": (len(waits) - before) / (STEPS - 1), "views_of_partitions": views,
            "persistent": sum(bool(p.ds_persist) for p in params), "params": len(params)}


def test_one_rank_zero3_persists_every_parameter_as_views_and_trains_the_same():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    fetched, persistent = json.loads(out.stdout.strip().splitlines()[-1])
    # Fetched per module: 2 Linear layers, forward and backward, a wait (a device sync on a GPU) each.
    assert fetched["persistent"] == 0 and fetched["waits_per_step"] >= 4
    # Persistent: gathered once, after each step.
    assert persistent["persistent"] == persistent["params"] and persistent["waits_per_step"] <= 1
    assert persistent["views_of_partitions"]  # one rank: the gathered parameter is its partition
    assert persistent["losses"] == fetched["losses"]


if __name__ == "__main__":
    from metaseq_ds.private_apis.deepspeed_optimizers import one_rank_persistence_threshold

    print(json.dumps([run_steps(0), run_steps(one_rank_persistence_threshold())]))
