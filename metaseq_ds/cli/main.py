"""`mseq`: the typer app. Each command is a thin shell that imports its module on use, or (generate,
serve: runnable alone under a launcher) the command's own module, which imports torch only when it
runs, so `mseq --help` never imports torch or deepspeed.

`train` takes metaseq's flags (hundreds, some from plugins), which are parsed by
`metaseq_ds.options` from the config dataclasses; typer only routes to it.
"""

from typing import List, Optional

import typer

from metaseq_ds import __version__
from metaseq_ds.checkpoint.reshard import TargetLayout
from metaseq_ds.cli import generate, serve  # their typer commands: pydantic and typer only, no torch
from metaseq_ds.cli.guard import install_compat, run_guarded
from metaseq_ds.cli.preprocess import PreprocessOptions
from metaseq_ds.dataclass.configs import DatasetConfig  # pydantic only, as the one below
from metaseq_ds.dataclass.constraints import describe_range
from migrate.options import Options as MigrateOptions

app = typer.Typer(
    name="mseq",
    help="metaseq-ds: train, validate and serve OPT-style language models on DeepSpeed.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=PASS_THROUGH, add_help_option=False)
def train(ctx: typer.Context) -> None:
    """Train a language model (metaseq's flags; `mseq train --help` lists them). With no data: a demo."""
    from metaseq_ds.cli import train as train_module

    train_module.cli_main(list(ctx.args))


@app.command()
def validate(
    path: str = typer.Option(..., "--path", help="checkpoint: a save dir (its last checkpoint) or a checkpoint_* dir"),
    valid_subset: Optional[str] = typer.Option(None, "--valid-subset", help="comma-separated splits (default: the run's)"),
    data: Optional[str] = typer.Option(None, "--data", help="data directory (default: the run's)"),
    batch_size: Optional[int] = typer.Option(
        None, "--batch-size", help="sequences per batch (default: the run's)" + describe_range(DatasetConfig, "batch_size")),
    max_valid_steps: Optional[int] = typer.Option(
        None, "--max-valid-steps", help="at most N batches per split" + describe_range(DatasetConfig, "max_valid_steps")),
    user_dir: Optional[str] = typer.Option(
        None, "--user-dir", help="the run's plugin (default: the --user-dir it was trained with)"),
) -> None:
    """Report a checkpoint's loss (base 2), perplexity and its criterion's other metrics on validation splits."""
    from metaseq_ds.cli import validate as validate_module

    run_guarded("validate", validate_module.main, path, valid_subset, data, batch_size, max_valid_steps, user_dir)


app.command("generate")(generate.command)
app.command("serve")(serve.command)


@app.command()
def migrate(
    paths: List[str] = typer.Argument(..., help="files or directories to migrate (in place)"),
    diff: bool = typer.Option(False, "--diff", help="print a unified diff and write nothing"),
    check: bool = typer.Option(False, "--check", help="write nothing; exit 1 if anything would change (for CI)"),
    report: Optional[str] = typer.Option(None, "--report", metavar="FILE", help="write every item as JSON: file, line, col, kind, old, new, reason"),
    jobs: int = typer.Option(1, "-j", "--jobs", help="worker processes" + describe_range(MigrateOptions, "jobs")),
    exclude: List[str] = typer.Option([], "--exclude", metavar="GLOB", help="skip matching paths (repeatable); .git, .venv, build, dist, site-packages and @generated files are always skipped"),
    shell: bool = typer.Option(False, "--shell", help="also rewrite fairseq-train / metaseq-train / python -m metaseq.cli.train in shell scripts"),
) -> None:
    """Rewrite fairseq/metaseq imports and renamed names to metaseq_ds; report what needs a person.

    Exit codes: 0 done, 1 --check found work, 2 usage error, 3 some file failed (the others are migrated).
    """
    from migrate import runner

    run_guarded("migrate", runner.main, MigrateOptions(paths, diff, check, report, jobs, exclude, shell))


@app.command()
def preprocess(
    data: str = typer.Argument(..., metavar="DATA", help="data directory in metaseq's layout: train/00/*.jsonl, valid/00/*.jsonl, ..."),
    workers: Optional[int] = typer.Option(
        None, "--workers", help="tokenizing processes (default: this machine's CPUs)" + describe_range(PreprocessOptions, "workers")),
    hf_tokenizer: Optional[str] = typer.Option(None, "--hf-tokenizer", help="a Hugging Face tokenizer.json, as for mseq train"),
    vocab_filename: Optional[str] = typer.Option(None, "--vocab-filename", help="GPT-2 BPE vocab.json (with --merges-filename)"),
    merges_filename: Optional[str] = typer.Option(None, "--merges-filename", help="GPT-2 BPE merges.txt (with --vocab-filename)"),
    end_of_document_symbol: str = typer.Option("</s>", "--end-of-document-symbol", help="token appended to every document"),
    data_cache_dir: Optional[str] = typer.Option(None, "--data-cache-dir", help="where to keep the stores (default: DATA/.token_store)"),
) -> None:
    """Tokenize a corpus once into memory-mapped token stores (mseq train does it on first use)."""
    from metaseq_ds.cli import preprocess as preprocess_module

    run_guarded("preprocess", preprocess_module.main, data, workers, hf_tokenizer, vocab_filename, merges_filename,
                end_of_document_symbol, data_cache_dir)


export_app = typer.Typer(help="Convert our checkpoints to other formats.", no_args_is_help=True)
import_app = typer.Typer(help="Convert other formats to our checkpoints (weights only, update 0).", no_args_is_help=True)
app.add_typer(export_app, name="export")
app.add_typer(import_app, name="import")


@export_app.command("hf")
def export_hf(
    checkpoint: str = typer.Argument(..., metavar="CKPT", help="a save dir (its last checkpoint) or a checkpoint_* dir, any ZeRO stage and rank count"),
    out: str = typer.Argument(..., metavar="OUT", help="new folder for the Hugging Face model (must not exist, or be empty)"),
    dtype: str = typer.Option("fp32", "--dtype", help="weights dtype: fp32, fp16 or bf16"),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="split model.safetensors into shards of at most this size (more than 0: 5GB, 500MB, 2KB or bytes)"),
) -> None:
    """Write a Hugging Face OPTForCausalLM folder: config, generation config, safetensors, tokenizer."""
    from metaseq_ds.cli import export

    run_guarded("export hf", export.hf, checkpoint, out, dtype, max_shard_size)


@import_app.command("hf")
def import_hf(
    hf_dir: str = typer.Argument(..., metavar="HF_DIR", help="a Hugging Face OPT folder (config.json, safetensors or pytorch_model.bin)"),
    out: str = typer.Argument(..., metavar="OUT", help="new checkpoint dir (must not exist, or be empty)"),
) -> None:
    """Hugging Face OPT -> our checkpoint (for train --restore-file, validate/generate --path)."""
    from metaseq_ds.cli import import_

    run_guarded("import hf", import_.hf, hf_dir, out)


@import_app.command("metaseq")
def import_metaseq(
    checkpoint: str = typer.Argument(..., metavar="CKPT", help="a metaseq/fairseq .pt: singleton, or one PREFIX-model_part-R.pt of the parts"),
    out: str = typer.Argument(..., metavar="OUT", help="new checkpoint dir (must not exist, or be empty)"),
    hf_tokenizer: Optional[str] = typer.Option(None, "--hf-tokenizer", help="tokenizer.json of the model (default: the checkpoint's, if found)"),
    vocab_filename: Optional[str] = typer.Option(None, "--vocab-filename", help="GPT-2 BPE vocab.json (with --merges-filename)"),
    merges_filename: Optional[str] = typer.Option(None, "--merges-filename", help="GPT-2 BPE merges.txt (with --vocab-filename)"),
) -> None:
    """metaseq or fairseq transformer_lm checkpoint -> our checkpoint (fused qkv, model-parallel parts)."""
    from metaseq_ds.cli import import_

    run_guarded("import metaseq", import_.metaseq, checkpoint, out, hf_tokenizer, vocab_filename, merges_filename)


@app.command()
def reshard(
    checkpoint: str = typer.Argument(..., metavar="CKPT", help="a save dir (its last checkpoint) or a checkpoint_* dir, any layout"),
    out: str = typer.Argument(..., metavar="OUT", help="new folder for the resharded checkpoint (must not exist, or be empty)"),
    ranks: int = typer.Option(..., "--ranks", help="ranks of the run that will resume it" + describe_range(TargetLayout, "ranks")),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size",
        help="its tensor-parallel degree (divides --ranks and the heads)" + describe_range(TargetLayout, "tensor_parallel_size")),
    zero_stage: Optional[int] = typer.Option(
        None, "--zero-stage", help="its ZeRO stage (default: the checkpoint's)" + describe_range(TargetLayout, "zero_stage")),
) -> None:
    """Consolidate a training checkpoint (weights, fp32 master weights, Adam moments and step, data position) for another layout."""
    from metaseq_ds.cli import reshard as reshard_module

    run_guarded("reshard", reshard_module.main, checkpoint, out, ranks, tensor_parallel_size, zero_stage)


def _version(value: bool) -> None:
    if value:
        print(f"metaseq-ds {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version"),
) -> None:
    """metaseq-ds: train, validate and serve OPT-style language models on DeepSpeed."""


def main(argv: Optional[List[str]] = None) -> None:
    install_compat()
    app(args=argv, prog_name="mseq")


if __name__ == "__main__":
    main()
