"""`--compile-layers`: each decoder layer compiled, one graph for all, no graph break, no
recompilation across layers or updates, and the losses of eager training (fp32) under ZeRO-0 and
ZeRO-3 (where the compiled layers are leaf modules and ZeRO-3's hooks stay outside the graph)."""

from pathlib import Path

import pytest

from launch import env


def run_compile_worker(*stages: int) -> dict:
    import json
    import subprocess
    import sys

    worker = Path(__file__).with_name("compile_worker.py")
    result = subprocess.run([sys.executable, str(worker), *map(str, stages)], capture_output=True, text=True,
                            env=env(), timeout=300, cwd=worker.parent)
    lines = [line for line in result.stdout.splitlines() if line.startswith("COMPILE ")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def test_compiled_layers_train_as_eager_ones_in_one_graph_under_zero_0_and_3():
    runs = run_compile_worker(0, 3)
    for stage, run in runs.items():
        assert run["compiled"] == pytest.approx(run["eager"], rel=0, abs=1e-5), stage
        # one graph for the 3 layers, made once (a recompilation would be a second frame)
        assert (run["graphs"], run["graph_breaks"], run["frames"]) == (1, {}, 1), stage
