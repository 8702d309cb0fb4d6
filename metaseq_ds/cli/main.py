"""`mseq`: the typer app. Each command is a thin shell that imports its module on use,
so `mseq --help` never imports torch or deepspeed.

`train` takes metaseq's flags (hundreds, some from plugins), which are parsed by
`metaseq_ds.options` from the config dataclasses; typer only routes to it.
"""

import sys
from typing import List, Optional

import typer

from metaseq_ds import __version__
from metaseq_ds.errors import UsageError

app = typer.Typer(
    name="mseq",
    help="metaseq-ds: train, validate and serve OPT-style language models on DeepSpeed.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def run_guarded(command: str, fn, *args) -> None:
    """Run a command; a UsageError becomes one line on stderr and exit code 2."""
    try:
        fn(*args)
    except UsageError as error:
        print(f"mseq {command}: error: {error}", file=sys.stderr)
        raise SystemExit(error.exit_code) from None


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
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="sequences per batch (default: the run's)"),
    max_valid_steps: Optional[int] = typer.Option(None, "--max-valid-steps", help="at most N batches per split"),
) -> None:
    """Report loss (base 2) and perplexity of a checkpoint on validation splits."""
    from metaseq_ds.cli import validate as validate_module

    run_guarded("validate", validate_module.main, path, valid_subset, data, batch_size, max_valid_steps)


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
    app(args=argv, prog_name="mseq")


if __name__ == "__main__":
    main()
