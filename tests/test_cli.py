"""The `mseq` CLI: frozen command set, --help snapshots, fast start, usage errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from metaseq_ds.cli.main import app

SNAPSHOTS = Path(__file__).parent / "snapshots"
COMMANDS = ["train", "validate", "generate", "serve", "export", "import", "migrate", "reshard", "preprocess"]


def _invoke(args):
    return CliRunner().invoke(app, args, env={"COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"})


def _check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("UPDATE_SNAPSHOTS") or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_SNAPSHOTS=1 if intended"


def test_command_set_is_frozen():
    import typer.main

    group = typer.main.get_command(app)
    assert sorted(group.commands) == sorted(COMMANDS)


@pytest.mark.parametrize(
    "args", [[], ["validate"], ["generate"], ["serve"], ["export", "hf"], ["import", "hf"], ["import", "metaseq"],
             ["migrate"], ["reshard"], ["preprocess"]],
    ids=["mseq", "validate", "generate", "serve", "export_hf", "import_hf", "import_metaseq", "migrate", "reshard",
         "preprocess"],
)
def test_help_snapshots(args):
    result = _invoke(args + ["--help"])
    assert result.exit_code == 0, result.output
    _check_snapshot("help_" + ("_".join(args) or "mseq"), result.output)


def test_train_help_lists_metaseq_flags_with_descriptions():
    result = _invoke(["train", "--help"])
    assert result.exit_code == 0, result.output
    for needle in ["--max-update", "stop after N updates", "--adam-betas", "--tokens-per-sample",
                   "--sample-break-mode", "--deepspeed-config", "--decoder-layers"]:
        assert needle in result.output


def test_help_path_imports_neither_torch_nor_deepspeed():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from metaseq_ds.cli.main import app\n"
        "result = CliRunner().invoke(app, ['--help'])\n"
        "assert result.exit_code == 0, result.output\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_usage_error_is_one_line_and_exit_2_through_the_real_console_script(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "metaseq_ds.cli.main", "train", str(tmp_path / "nope"), "--lrr", "1"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "mseq train: error: unknown flag --lrr; did you mean '--lr'?"


def test_validate_bad_path_is_one_line(tmp_path):
    result = _invoke(["validate", "--path", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a checkpoint" in result.output and "Traceback" not in result.output
