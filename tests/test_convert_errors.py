"""Bad input to `mseq export` / `mseq import`: one line, exit code 2, nothing left in OUT."""

import json

import pytest
import torch
from typer.testing import CliRunner

from convert_helpers import variant_flags, write_zero0_checkpoint
from metaseq_ds.cli.main import app


def invoke(args):
    return CliRunner().invoke(app, args, env={"COLUMNS": "200", "NO_COLOR": "1"})


def assert_clean_failure(result, out, expected: str):
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1 and expected in errors[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_export_of_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    assert_clean_failure(invoke(["export", "hf", str(tmp_path / "notes"), str(tmp_path / "out")]),
                         tmp_path / "out", "is not a checkpoint")


def test_export_of_a_truncated_checkpoint(tmp_path):
    write_zero0_checkpoint(tmp_path / "ckpt", variant_flags("pre_ln"))
    _truncate(tmp_path / "ckpt" / "checkpoint_1_0" / "mp_rank_00_model_states.pt")
    assert_clean_failure(invoke(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]),
                         tmp_path / "out", "cannot read the weights")


def test_export_of_an_unknown_architecture(tmp_path):
    write_zero0_checkpoint(tmp_path / "ckpt", variant_flags("pre_ln"))
    meta_file = tmp_path / "ckpt" / "checkpoint_1_0" / "metaseq_ds.json"
    meta = json.loads(meta_file.read_text())
    meta["config"]["model"]["_name"], meta["config"]["arch"] = "my_plugin_lm", "my_plugin_lm_big"
    meta_file.write_text(json.dumps(meta))
    assert_clean_failure(invoke(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]),
                         tmp_path / "out", "has no Hugging Face OPT equivalent")


def test_export_refuses_a_non_empty_out_and_leaves_it_alone(tmp_path):
    write_zero0_checkpoint(tmp_path / "ckpt", variant_flags("pre_ln"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep me")
    result = invoke(["export", "hf", str(tmp_path / "ckpt"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "already exists and is not empty" in result.output
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]


def test_import_hf_of_another_model_type(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path / "gpt2")
    assert_clean_failure(invoke(["import", "hf", str(tmp_path / "gpt2"), str(tmp_path / "out")]),
                         tmp_path / "out", "holds a 'gpt2' model; only OPT")


def test_import_hf_of_a_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_clean_failure(invoke(["import", "hf", str(tmp_path / "empty"), str(tmp_path / "out")]),
                         tmp_path / "out", "not a Hugging Face model folder")


def test_import_hf_of_truncated_weights(tmp_path):
    from test_import import random_hf_opt

    random_hf_opt().save_pretrained(tmp_path / "hf")
    _truncate(tmp_path / "hf" / "model.safetensors")
    assert_clean_failure(invoke(["import", "hf", str(tmp_path / "hf"), str(tmp_path / "out")]),
                         tmp_path / "out", "model.safetensors: cannot read")


@pytest.mark.parametrize("case, expected", [
    ("truncated", "cannot read (truncated"),
    ("unknown_arch", "unknown architecture 'transformer'"),
    ("not_a_file", "is not a file"),
    ("foreign_class", "needs class subprocess.Popen"),
])
def test_import_metaseq_bad_input(case, expected, tmp_path):
    path = tmp_path / "checkpoint.pt"
    state = {"model": {"decoder.embed_tokens.weight": torch.zeros(8, 4)}, "cfg": {"model": {"_name": "transformer_lm"}}}
    if case == "truncated":
        torch.save({**state, "pad": torch.zeros(1000)}, path)
        _truncate(path)
    elif case == "unknown_arch":
        torch.save({**state, "cfg": {"model": {"_name": "transformer"}}}, path)
    elif case == "foreign_class":
        import subprocess

        torch.save({**state, "extra_state": subprocess.Popen}, path)
    assert_clean_failure(invoke(["import", "metaseq", str(path), str(tmp_path / "out")]), tmp_path / "out", expected)


def test_import_metaseq_on_an_untested_torch_names_the_private_api_not_the_file(tmp_path, monkeypatch):
    """A checkpoint with a class outside torch's allow-list is read by our unpickler, built on a
    private torch table: on another torch the gate's own line, not "cannot read (truncated ...)"."""
    import subprocess
    from importlib import metadata

    from metaseq_ds.private_apis import verified

    path = tmp_path / "checkpoint.pt"
    torch.save({"model": {}, "extra_state": subprocess.Popen}, path)
    real_version = metadata.version
    monkeypatch.setattr(verified.metadata, "version", lambda name: "2.11.0" if name == "torch" else real_version(name))
    monkeypatch.delenv(verified.ALLOW_UNTESTED, raising=False)
    verified.require_tested.cache_clear()
    try:
        result = invoke(["import", "metaseq", str(path), str(tmp_path / "out")])
        assert_clean_failure(result, tmp_path / "out", "relies on torch's private torch._weights_only_unpickler."
                             "_get_allowed_globals, written for torch 2.13.x; this is torch 2.11.0: install a verified version")
        assert "cannot read" not in result.output
    finally:
        verified.require_tested.cache_clear()
