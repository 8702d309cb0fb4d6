"""What every command shares: a user's mistake as one line and exit 2, the opt-in `compat` hook,
and a command run on its own under a launcher (`deepspeed --module metaseq_ds.cli.generate`)."""

import sys
from contextlib import contextmanager
from typing import Callable, List

import typer

from metaseq_ds.errors import UsageError


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


def install_compat() -> None:
    from metaseq_ds.user_code import install_compat_if_asked

    run_guarded("compat", install_compat_if_asked)  # plugins that `import fairseq` and cannot be edited


def run_alone(name: str, command: Callable, argv: List[str]) -> None:
    """`mseq NAME`'s typer command as a program of its own: `deepspeed --module metaseq_ds.cli.NAME ...`
    (or torchrun -m). The rank comes from the environment; the deepspeed launcher's own
    --local_rank=N is not ours."""
    install_compat()
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name)(command)
    app(args=[arg for arg in argv if not arg.startswith("--local_rank")], prog_name=f"mseq {name}")
