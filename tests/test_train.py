"""`mseq train` end to end, as real processes: logs, checkpoints, resume, launchers, errors."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import TINY, env, log_records, losses, run, tree_digest, write_corpus

# metaseq's train_inner keys; "clip" (percent of updates clipped) only with --clip-norm, as in metaseq
LOG_KEYS = {"epoch", "update", "loss", "ppl", "wps", "ups", "wpb", "bsz", "num_updates", "lr", "gnorm",
            "train_wall", "wall"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), shards=2)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("run") / "ckpt"
    result = run([str(corpus), *TINY, "--max-update", "6", "--batch-size", "4", "--save-dir", str(save_dir),
                  "--save-interval-updates", "3", "--validate-interval-updates", "3", "--keep-last-updates", "1",
                  "--tensorboard-logdir", str(save_dir.parent / "tb")])
    return save_dir, result


def test_single_process_run_logs_metaseq_json_and_saves(trained):
    save_dir, result = trained
    records = log_records(result.stdout)
    assert [r["num_updates"] for r in records] == [1, 2, 3, 4, 5, 6]
    for record in records:
        assert set(record) == LOG_KEYS
        assert all(isinstance(v, (int, float)) for v in record.values())
        assert abs(record["ppl"] - 2 ** record["loss"]) < 1e-3 * record["ppl"]
    assert records[-1]["loss"] < records[0]["loss"]
    valid = log_records(result.stdout, "valid")
    assert len(valid) >= 2 and all("valid_loss" in v for v in valid)
    assert (save_dir / "checkpoint_last").read_text().strip() == "checkpoint_1_6"
    assert not (save_dir / "checkpoint_1_3").exists()  # --keep-last-updates 1
    assert list((save_dir.parent / "tb").glob("events.out.tfevents.*"))


def test_validate_reports_loss_per_subset(trained):
    save_dir, _ = trained
    result = subprocess.run([sys.executable, "-m", "metaseq_ds.cli.main", "validate", "--path", str(save_dir)],
                            capture_output=True, text=True, env=env())
    assert result.returncode == 0, result.stderr
    line = [l for l in result.stdout.splitlines() if l.startswith("valid: loss")]
    assert line and "ppl" in line[0] and "update 6" in line[0]


def test_default_save_dir_is_checkpoints_in_the_working_directory(corpus):
    result = run([str(corpus), *TINY, "--max-update", "2", "--batch-size", "4", "--disable-validation"])
    assert Path("checkpoints", "checkpoint_last").read_text().strip() == "checkpoint_1_2"
    assert "mseq validate --path checkpoints" in result.stdout


def test_demo_writes_its_corpus_to_data_and_ends_with_loss_and_entropy():
    """README command 1, shortened: no DATA; CI (.ci/run) reads the last two lines checked here."""
    result = run(["--max-update", "2", "--max-valid-steps", "1"])
    assert (Path("data") / "demo_corpus" / "demo_corpus.json").is_file()
    assert Path("checkpoints", "checkpoint_last").read_text().strip() == "checkpoint_1_2"
    assert re.search(r"^valid: loss \d+\.\d+ bits/token, ppl", result.stdout, re.MULTILINE), result.stdout[-2000:]
    assert re.search(r"^byte-unigram entropy of the demo corpus: \d+\.\d+ bits/token$", result.stdout, re.MULTILINE)


@pytest.mark.slow
def test_same_loss_curve_alone_under_deepspeed_zero3_and_with_update_freq(corpus, tmp_path):
    common = [str(corpus), *TINY, "--max-update", "8", "--dropout", "0", "--attention-dropout", "0", "--no-save",
              "--disable-validation", "--share-decoder-input-output-embed"]
    alone = losses(run(common + ["--batch-size", "8"]).stdout)
    # the tied embedding streamed, recomputing its loss (distributed.tied_embedding)
    zero3 = losses(run(common + ["--batch-size", "4", "--zero-stage", "3", "--checkpoint-activations"],
                       launcher="deepspeed").stdout)
    accumulated = losses(run(common + ["--batch-size", "4", "--update-freq", "2"]).stdout)
    assert len(alone) == 8
    for other in (zero3, accumulated):
        assert other.keys() == alone.keys()
        for step, loss in alone.items():
            assert abs(other[step] - loss) <= 1e-5 * abs(loss), (step, loss, other[step])


def test_batches_prepared_by_dataloader_workers_train_and_validate_as_in_the_step(corpus):
    common = [str(corpus), *TINY, "--max-update", "4", "--batch-size", "4", "--dropout", "0", "--attention-dropout", "0",
              "--no-save", "--validate-interval-updates", "2"]
    in_step = run(common + ["--data-buffer-size", "0"])
    workers = run(common + ["--num-workers", "2", "--data-buffer-size", "4"])
    assert len(losses(in_step.stdout)) == 4 and losses(workers.stdout) == losses(in_step.stdout)
    valid = [[r["valid_loss"] for r in log_records(result.stdout, "valid")] for result in (in_step, workers)]
    assert len(valid[0]) >= 2 and valid[1] == valid[0]
    assert "num-workers" not in workers.stderr  # no longer a flag accepted without effect


@pytest.mark.slow
def test_torchrun_launch_trains(corpus, tmp_path):
    result = run([str(corpus), *TINY, "--max-update", "3", "--batch-size", "2", "--no-save", "--disable-validation"],
                 launcher="torchrun")
    assert len(losses(result.stdout)) == 3


@pytest.mark.slow
def test_sigkill_after_a_checkpoint_then_rerun_resumes_exactly(corpus, tmp_path):
    args = [str(corpus), *TINY, "--max-update", "30", "--batch-size", "4", "--dropout", "0.1",
            "--save-interval-updates", "4", "--disable-validation"]
    reference = losses(run(args + ["--save-dir", str(tmp_path / "reference")]).stdout)

    save_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "metaseq_ds.cli.main", "train", *args, "--save-dir", str(save_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env())
    deadline = time.time() + 240
    while not (save_dir / "checkpoint_last").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed_from = int((save_dir / "checkpoint_last").read_text().strip().rsplit("_", 1)[1])
    assert resumed_from < 30, "the run finished before it could be killed"

    resumed = losses(run(args + ["--save-dir", str(save_dir)]).stdout)
    assert min(resumed) == resumed_from + 1 and max(resumed) == 30
    for step, loss in resumed.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=0), step


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", None], ids=["two_ranks", "one_rank"])
def test_zero3_bf16_resume_continues_like_an_unbroken_run(corpus, tmp_path, launcher):
    """Two ranks under the launcher; one rank alone, where every parameter persists (its
    partition's view) through the checkpoint's partition and re-gather."""
    args = [str(corpus), *TINY, "--batch-size", "2", "--bf16", "--zero-stage", "3", "--save-interval-updates", "2",
            "--disable-validation"]
    unbroken = losses(run(args + ["--max-update", "4", "--save-dir", str(tmp_path / "a")], launcher=launcher).stdout)
    run(args + ["--max-update", "2", "--save-dir", str(tmp_path / "b")], launcher=launcher)
    resumed = losses(run(args + ["--max-update", "4", "--save-dir", str(tmp_path / "b")], launcher=launcher).stdout)
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: unbroken[step] for step in (3, 4)}
    last_rank = 1 if launcher else 0
    assert len(list((tmp_path / "b" / "checkpoint_1_2").glob(f"*zero_pp_rank_{last_rank}_*"))) == 2  # params + optimizer


def _bpe_files(folder: Path):
    from tokenizers import ByteLevelBPETokenizer

    from launch import WORDS

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator([" ".join(WORDS)] * 20, vocab_size=300,
                                  special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    tokenizer.save_model(str(folder))
    return folder / "vocab.json", folder / "merges.txt"


def _cpu_has_fp16() -> bool:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())


def test_metaseq_documented_command_runs_with_fp16_fallback(tmp_path):
    vocab, merges = _bpe_files(tmp_path)
    corpus = write_corpus(tmp_path / "corpus", docs=1600)  # 1024-token samples, batch 8
    result = run([
        "--task", "streaming_language_modeling", str(corpus), "--vocab-filename", str(vocab),
        "--merges-filename", str(merges), "--criterion", "cross_entropy", "--batch-size", "8",
        "--arch", "transformer_lm_gpt2_tiny", "--share-decoder-input-output-embed", "--dropout", "0.1",
        "--optimizer", "adam", "--weight-decay", "0.01", "--clip-norm", "0.0", "--lr", "0.0005",
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000", "--warmup-init-lr", "1e-07",
        "--tokens-per-sample", "1024", "--sample-break-mode", "none", "--use-sharded-state",
        "--decoder-learned-pos", "--log-format", "json", "--log-interval", "1", "--fp16",
        "--max-update", "2", "--save-dir", str(tmp_path / "ckpt"), "--progress-bar", "none",
    ])
    # DeepSpeed's CPU accelerator trains in fp16 where oneDNN has fp16 kernels (AVX512-FP16: Intel
    # Xeon since Sapphire Rapids), else --fp16 falls back with a warning (AMD EPYC): to bf16, or to
    # fp32 where the CPU has no bf16 kernels either (AVX2).
    assert ("--fp16: this accelerator has no fp16 training support" in result.stderr) != _cpu_has_fp16()
    assert "--use-sharded-state is implied" in result.stderr
    assert len(losses(result.stdout)) == 2


@pytest.mark.parametrize("case", ["missing_data", "no_shards", "malformed_line", "unknown_flag", "invalid_value",
                                  "other_arch"])
def test_bad_input_is_one_line_exit_2_and_checkpoints_untouched(case, corpus, trained, tmp_path):
    save_dir, _ = trained
    before = tree_digest(save_dir)
    data = str(corpus)
    extra, expected = [], ""
    if case == "missing_data":
        data, expected = str(tmp_path / "nowhere"), "does not exist"
    elif case == "no_shards":
        (tmp_path / "empty" / "train").mkdir(parents=True)
        data, expected = str(tmp_path / "empty"), "no shard"
    elif case == "malformed_line":
        bad = write_corpus(tmp_path / "bad")
        lines = (bad / "train" / "00" / "part.jsonl").read_text().splitlines()
        lines[1::2] = ['{"text": oops}'] * len(lines[1::2])  # met by the first batch, whatever the order
        (bad / "train" / "00" / "part.jsonl").write_text("\n".join(lines) + "\n")
        data, expected = str(bad), "part.jsonl:"
    elif case == "unknown_flag":
        extra, expected = ["--max-updat", "3"], "did you mean '--max-update'"
    elif case == "invalid_value":
        extra, expected = ["--batch-size", "many"], "invalid value 'many' for --batch-size"
    elif case == "other_arch":
        extra, expected = ["--decoder-layers", "3"], "holds a checkpoint of another model"
    # --max-update beyond the saved 6, so a run that got past the checks would train and save.
    result = run([data, *TINY, "--max-update", "12", "--batch-size", "4", "--save-dir", str(save_dir), *extra],
                 check=False, timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("mseq train: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert tree_digest(save_dir) == before


@pytest.mark.slow
def test_zero3_offload_preset_trains_with_our_optimizer(corpus):
    result = run([str(corpus), *TINY, "--batch-size", "2", "--max-update", "2", "--no-save", "--disable-validation",
                  "--deepspeed-config", "zero3_offload"])
    assert sorted(losses(result.stdout)) == [1, 2]
    assert "ZeRO stage 3" in result.stdout
