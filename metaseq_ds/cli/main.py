"""`mseq`: the typer app. Each command is a thin shell that imports its module on use,
so `mseq --help` never imports torch or deepspeed.

`train` takes metaseq's flags (hundreds, some from plugins), which are parsed by
`metaseq_ds.options` from the config dataclasses; typer only routes to it.
"""

import sys
from contextlib import contextmanager
from typing import List, Optional

import typer

from metaseq_ds import __version__
from metaseq_ds.cli.preprocess import PreprocessOptions
from metaseq_ds.dataclass.configs import DatasetConfig  # pydantic only, as the two below
from metaseq_ds.dataclass.constraints import describe_range
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions  # pydantic only: --help stays free of torch
from metaseq_ds.reshard import TargetLayout
from metaseq_ds.serving.options import ServeOptions
from migrate.options import Options as MigrateOptions

app = typer.Typer(
    name="mseq",
    help="metaseq-ds: train, validate and serve OPT-style language models on DeepSpeed.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@contextmanager
def guarded(command: str):
    """A UsageError raised inside becomes one line on stderr and exit code 2."""
    try:
        yield
    except UsageError as error:
        print(f"mseq {command}: error: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None


def run_guarded(command: str, fn, *args) -> None:
    """Run a command's function under `guarded`."""
    with guarded(command):
        fn(*args)


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
) -> None:
    """Report loss (base 2) and perplexity of a checkpoint on validation splits."""
    from metaseq_ds.cli import validate as validate_module

    run_guarded("validate", validate_module.main, path, valid_subset, data, batch_size, max_valid_steps)


def _flag(field: str) -> str:
    """`mseq generate`'s flag for a GenerationOptions field."""
    return "--" + field.replace("_", "-")


def _sampling_flag(field: str):
    """A `mseq generate` flag whose default and help (description, range) are the options' field's."""
    return typer.Option(GenerationOptions.model_fields[field].default, _flag(field),
                        help=GenerationOptions.describe(field, _flag))


@app.command()
def generate(
    prompts: Optional[List[str]] = typer.Argument(None, help="prompts (none: --input-file, or an interactive prompt on a terminal)"),
    path: str = typer.Option(..., "--path", help="checkpoint: a save dir (its last checkpoint) or a checkpoint_* dir"),
    input_file: Optional[str] = typer.Option(None, "--input-file", help="prompts, one per line, or .jsonl with a \"prompt\" field"),
    max_tokens: int = _sampling_flag("max_tokens"),
    min_tokens: int = _sampling_flag("min_tokens"),
    temperature: float = _sampling_flag("temperature"),
    top_p: float = _sampling_flag("top_p"),
    top_k: int = _sampling_flag("top_k"),
    n: int = _sampling_flag("n"),
    best_of: Optional[int] = _sampling_flag("best_of"),
    logprobs: int = _sampling_flag("logprobs"),
    echo: bool = _sampling_flag("echo"),
    stop: Optional[List[str]] = typer.Option(None, "--stop", help=GenerationOptions.describe("stop", _flag) + "; repeatable"),
    seed: Optional[int] = _sampling_flag("seed"),
    length_penalty: float = _sampling_flag("length_penalty"),
    output_format: str = typer.Option("text", "--output-format", help="text, or jsonl (metaseq's result dicts)"),
) -> None:
    """Complete prompts with a checkpoint: greedy, sampling (top-k/top-p) or beam search."""
    from metaseq_ds.cli import generate as generate_module

    values = dict(max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                  n=n, best_of=best_of, logprobs=logprobs, echo=echo, stop=stop or (), seed=seed,
                  length_penalty=length_penalty)
    with guarded("generate"):
        options = GenerationOptions.from_values(values, name=_flag)
        generate_module.main(prompts or [], path, input_file, options, output_format)


@app.command()
def serve(
    path: str = typer.Option(..., "--path", help="checkpoint: a save dir (its last checkpoint) or a checkpoint_* dir"),
    host: str = typer.Option(ServeOptions.host, "--host", help="address to listen on (0.0.0.0: every interface; give an --api-key then)"),
    port: int = typer.Option(ServeOptions.port, "--port",
                             help="TCP port (0: any free port; the address is printed)" + describe_range(ServeOptions, "port")),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MSEQ_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every route but /health"),
    max_batch_tokens: int = typer.Option(
        ServeOptions.max_batch_tokens, "--max-batch-tokens",
        help="decode at most this many KV-cache positions per batch (sequences x (longest prompt + most new tokens)); "
             "larger requests are refused" + describe_range(ServeOptions, "max_batch_tokens")),
    max_request_bytes: int = typer.Option(
        ServeOptions.max_request_bytes, "--max-request-bytes",
        help="refuse request bodies larger than this (HTTP 413)" + describe_range(ServeOptions, "max_request_bytes")),
) -> None:
    """Serve a checkpoint over HTTP: metaseq's hosted API, OpenAI-compatible completions, batched."""
    from metaseq_ds.cli import serve as serve_module

    run_guarded("serve", serve_module.main, ServeOptions(path, host, port, api_key, max_batch_tokens, max_request_bytes))


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
    from metaseq_ds.user_code import install_compat_if_asked

    run_guarded("compat", install_compat_if_asked)  # plugins that `import fairseq` and cannot be edited
    app(args=argv, prog_name="mseq")


if __name__ == "__main__":
    main()
