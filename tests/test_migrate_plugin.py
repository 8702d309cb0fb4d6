"""A fairseq-style plugin trains unmodified under compat, and again after `mseq migrate` without it.

Each run is a fresh process (the registries are global): tests/plugins/train_step.py builds the
plugin's task, model and criterion through metaseq_ds's own config parsing and takes 5 SGD steps.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

from migrate import runner

PLUGINS = Path(__file__).parent / "plugins"


def train_steps(plugin_dir: Path, *flags: str) -> dict:
    result = subprocess.run([sys.executable, str(PLUGINS / "train_step.py"), str(plugin_dir), *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_plugin_trains_unmodified_under_compat():
    out = train_steps(PLUGINS / "fairseq_style_plugin", "--compat")
    assert out["embed_dim"] == 8  # the fairseq-style architecture function ran
    assert out["losses"][-1] < 0.6 * out["losses"][0]
    assert "fairseq.models" in out["old_packages"]


def test_plugin_trains_after_migrate_without_compat(tmp_path):
    plugin = tmp_path / "fairseq_style_plugin"
    shutil.copytree(PLUGINS / "fairseq_style_plugin", plugin)
    assert runner.run(runner.Options([str(plugin)])) == 0
    imports = [line for line in (plugin / "__init__.py").read_text().splitlines() if line.startswith(("from ", "import "))]
    assert imports and not [line for line in imports if "fairseq" in line.split("#")[0]]
    out = train_steps(plugin)
    assert out["old_packages"] == []
    assert out["losses"][-1] < 0.6 * out["losses"][0]
