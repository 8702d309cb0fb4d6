"""`mseq generate` on a checkpoint that `mseq train` wrote: outputs, input files, seeds, bad input."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from launch import TINY, env, free_port, run, shm_leftovers, write_corpus
from metaseq_ds.cli.main import app


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    corpus = write_corpus(root / "corpus")
    save_dir = root / "ckpt"
    run([str(corpus), *TINY, "--max-update", "3", "--batch-size", "4", "--save-dir", str(save_dir),
         "--disable-validation"])
    return save_dir


def _generate(*args):
    return CliRunner().invoke(app, ["generate", *args], env={"COLUMNS": "100"})


def test_jsonl_output_has_metaseq_result_keys(checkpoint):
    result = _generate("--path", str(checkpoint), "the model", "weights", "--max-tokens", "6", "--temperature", "0",
                       "--logprobs", "2", "--output-format", "jsonl")
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["the model", "weights"]
    for record in records:
        assert {"text", "tokens", "text_offset", "token_scores", "top_logprobs", "finish_reason"} <= set(record)
        assert record["finish_reason"] in ("eos", "length", "stop")
        assert "".join(record["tokens"]) == record["text"]
        assert len(record["token_scores"]) == len(record["tokens"]) <= 6


def test_seeded_sampling_is_reproducible_and_input_files_are_read(checkpoint, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the data"}) + "\n" + json.dumps({"prompt": "loss"}) + "\n")
    args = ["--path", str(checkpoint), "--input-file", str(prompts), "--max-tokens", "8", "--temperature", "1.0",
            "--top-k", "20", "--top-p", "0.9", "--seed", "4", "--output-format", "jsonl"]
    first, second = _generate(*args), _generate(*args)
    assert first.exit_code == 0, first.output
    assert first.stdout == second.stdout
    assert [json.loads(line)["prompt"] for line in first.stdout.splitlines()] == ["the data", "loss"]


def test_compiled_and_uncompiled_decoding_complete_alike(checkpoint):
    """--compile (inductor here; the default on CUDA) and --no-compile (the CPU's default) give
    the same greedy completions."""
    args = ["--path", str(checkpoint), "the model", "a much longer prompt than that", "--max-tokens", "10",
            "--temperature", "0", "--output-format", "jsonl"]
    compiled, eager = _generate(*args, "--compile"), _generate(*args, "--no-compile")
    assert compiled.exit_code == 0, compiled.output
    assert eager.exit_code == 0, eager.output
    assert "without compiling" not in compiled.output  # it compiled, not fell back
    assert compiled.stdout == eager.stdout


def test_a_loaded_checkpoint_is_made_generation_fast_and_completes_as_the_plain_model(checkpoint):
    from metaseq_ds.checkpoint.inference import load_model_for_inference
    from metaseq_ds.hub_utils import GeneratorInterface

    interface = GeneratorInterface(str(checkpoint))
    [model] = interface.load_model()
    assert model.decoder.layers[0].fc1.weight.t().is_contiguous()  # laid out for decoding steps
    with pytest.raises(RuntimeError, match="cannot train"):
        model.train()
    _, task, plain, _ = load_model_for_inference(str(checkpoint), need_data=False)
    fast = interface.generate(["the model", "loss"], max_tokens=8, temperature=0, logprobs=2)
    as_trained = GeneratorInterface(model=plain, task=task).generate(["the model", "loss"], max_tokens=8,
                                                                      temperature=0, logprobs=2)
    assert plain.training is False and plain.decoder.layers[0].fc1.weight.is_contiguous()  # given, not changed
    for [mine], [reference] in zip(fast, as_trained):
        assert mine["tokens"] == reference["tokens"]
        assert mine["token_scores"] == pytest.approx(reference["token_scores"], abs=1e-5)


@pytest.mark.parametrize(
    "args, complaint",
    [
        (["--temperature", "-1", "x"], "--temperature must be >= 0"),
        (["--top-p", "0", "x"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5", "x"], "--top-p must be in (0, 1]"),
        ([""], "prompt 1 is empty"),
        (["word " * 40], "prompt 1 has 201 tokens; the model takes 32 positions"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(checkpoint, args, complaint):
    result = _generate("--path", str(checkpoint), *args)
    assert result.exit_code == 2, result.output
    assert complaint in result.output and "Traceback" not in result.output


def test_missing_checkpoint_is_refused_through_the_console_script(tmp_path):
    command = [sys.executable, "-m", "metaseq_ds.cli.main", "generate", "--path", str(tmp_path / "nope"), "hi"]
    missing = subprocess.run(command, capture_output=True, text=True, env=env())
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"mseq generate: error: --path: {tmp_path / 'nope'} is not a checkpoint " \
                                     "(expected a save dir with checkpoint_last, or a checkpoint_* dir)"


def test_under_the_deepspeed_launcher_the_model_is_sharded_and_gives_the_same_completions(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    save_dir = tmp_path / "ckpt"
    run([str(corpus), *TINY, "--decoder-attention-heads", "4", "--max-update", "3", "--batch-size", "4",
         "--save-dir", str(save_dir), "--disable-validation"])
    args = ["--path", str(save_dir), "the model", "loss", "--max-tokens", "8", "--output-format", "jsonl"]
    one_process = [_generate(*args, "--temperature", "0"), _generate(*args, "--temperature", "0.8", "--seed", "3")]
    for mode, single in zip((["--temperature", "0"], ["--temperature", "0.8", "--seed", "3"]), one_process):
        assert single.exit_code == 0, single.output
        port = free_port()
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
                   "--module", "metaseq_ds.cli.generate", *args, *mode]
        sharded = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=300)
        assert not shm_leftovers(port)
        records = [json.loads(line) for line in sharded.stdout.splitlines() if line.startswith('{"prompt"')]
        expected = [json.loads(line) for line in single.stdout.splitlines()]
        assert len(records) == 2, sharded.stdout[-2000:] + sharded.stderr[-2000:]
        for record, reference in zip(records, expected):
            assert (record["text"], record["tokens"], record["finish_reason"]) == \
                (reference["text"], reference["tokens"], reference["finish_reason"])
            assert record["token_scores"] == pytest.approx(reference["token_scores"], abs=1e-5)
