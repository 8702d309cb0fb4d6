"""Every numeric option outside its declared range is refused before any work: exit code 2, one
line naming the flag, no traceback, nothing written.

The sweep reads the ranges from where they are declared: the fields of every fixed config
section, of every component config metaseq_ds registers (models, tasks, criterions, optimizers,
LR schedulers) and of a plugin that declares ranges (tests/plugins/constrained_plugin), and
`mseq generate`'s `GenerationOptions`. A new numeric field is swept as soon as it exists; one
without a range must be listed in EXEMPT with the reason. Values tried: just outside each bound,
0 and -1 where the range excludes them (counts, sizes, intervals, probabilities), NaN and
infinities for floats. Most go through the parser in-process (`parse_train_config`, typer's
CliRunner); the issue's examples also through the real console script.

    python -m pytest -q -s tests/test_config_ranges.py   # prints how many fields and values were tried
"""

import math
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import annotated_types
import pytest
import typer.main
from typer.testing import CliRunner

from launch import env
from metaseq_ds.cli.main import app
from metaseq_ds.cli.preprocess import PreprocessOptions
from metaseq_ds.dataclass import FIXED_SECTIONS, DatasetConfig, MetaseqConfig
from metaseq_ds.dataclass.constraints import Bound, field_bounds, field_types, item_type, plain_type
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.options import component_registries, flag, parse_train_config
from metaseq_ds.checkpoint.reshard import TargetLayout
from metaseq_ds.serving.options import ServeOptions
from migrate.options import Options as MigrateOptions

PLUGIN = Path(__file__).parent / "plugins" / "constrained_plugin"
PLUGIN_CRITERION = "label_smoothed_cross_entropy_ranged"

# Numeric fields without a range, by (config class, field), and why none fits.
EXEMPT = {
    ("OptimizationConfig", "stop_min_lr"): "a threshold the learning rate is compared with: any finite value "
                                            "means something (a negative one never stops the run)",
    ("GenerationOptions", "length_penalty"): "an exponent of the beam length: below 1 favours short beams, "
                                             "above 1 long ones, any finite value is a choice",
}

# The issue's examples: they built the model and died with a traceback.
EXAMPLES = [
    ("--lr", "-1", "--lr must be > 0, got -1"),
    ("--batch-size", "0", "--batch-size must be >= 1, got 0"),
    ("--update-freq", "0", "--update-freq must be >= 1, got 0"),
    ("--dropout", "1.5", "--dropout must be in [0, 1), got 1.5"),
    ("--weight-decay", "-1", "--weight-decay must be >= 0, got -1"),
]


def numeric_kind(annotation: Any) -> Optional[type]:
    """int or float for a number field (or a tuple/list of numbers), else None (bool is not a number here)."""
    items = item_type(annotation)
    base = plain_type(items if items is not None else annotation)
    return base if base in (int, float) else None


def inside(bounds: Sequence[Any], value: float) -> bool:
    checks = {annotated_types.Ge: lambda b: value >= b.ge, annotated_types.Gt: lambda b: value > b.gt,
              annotated_types.Le: lambda b: value <= b.le, annotated_types.Lt: lambda b: value < b.lt}
    return all(checks[type(b)](b) for b in bounds)


def outside_values(bounds: Sequence[Any], kind: type) -> List[Any]:
    """Just outside each bound, 0 and -1 where the range excludes them, and the non-finite floats."""
    down = (lambda x: x - 1) if kind is int else (lambda x: math.nextafter(x, -math.inf))
    up = (lambda x: x + 1) if kind is int else (lambda x: math.nextafter(x, math.inf))
    values = []
    for bound in bounds:
        if isinstance(bound, annotated_types.Ge):
            values.append(down(bound.ge))
        elif isinstance(bound, annotated_types.Gt):
            values.append(bound.gt)
        elif isinstance(bound, annotated_types.Le):
            values.append(up(bound.le))
        elif isinstance(bound, annotated_types.Lt):
            values.append(bound.lt)
    values += [v for v in (0, -1) if not inside(bounds, v)]
    if kind is float:
        values += [math.nan, math.inf, -math.inf]
    return list(dict.fromkeys(kind(v) for v in values))


def as_text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


class Tally:
    """What the sweep tried and what went wrong, for one assertion that lists every failure."""

    def __init__(self):
        self.fields = self.values = 0
        self.exempt: List[Tuple[str, str]] = []
        self.failures: List[str] = []

    def check(self, where: str, message: Optional[str], flag_name: str) -> None:
        self.values += 1
        if message is None:
            self.failures.append(f"{where}: accepted")
        elif flag_name not in message or "\n" in message:
            self.failures.append(f"{where}: {message!r} is not one line naming {flag_name}")


# -- mseq train: every section and component config ------------------------------------------------

SELECTOR = {"task": "--task", "criterion": "--criterion", "optimizer": "--optimizer", "lr_scheduler": "--lr-scheduler"}


def train_configs() -> Iterator[Tuple[type, List[str]]]:
    """(config class, the flags that select it) for the fixed sections, each component config of
    metaseq_ds and the plugin's criterion."""
    from metaseq_ds.models import ARCH_MODEL_REGISTRY

    for name in FIXED_SECTIONS:
        yield MetaseqConfig.__dataclass_fields__[name].default_factory, []
    parse_train_config(["--user-dir", str(PLUGIN)])  # registers the plugin's criterion
    for section, registry in component_registries().items():
        for name in registry.choices():
            entry = registry.get(name)
            if entry.dataclass is None:
                continue
            if entry.cls.__module__.startswith("metaseq_ds."):
                if section == "model":
                    arch = name if ARCH_MODEL_REGISTRY.get(name) == name else \
                        next(a for a, model in ARCH_MODEL_REGISTRY.items() if model == name)
                    yield entry.dataclass, ["--arch", arch]
                else:
                    yield entry.dataclass, [SELECTOR[section], name]
            elif name == PLUGIN_CRITERION:
                yield entry.dataclass, ["--user-dir", str(PLUGIN), "--criterion", name]


def field_values(cls: type, name: str, kind: type, bounds: Sequence[Any]) -> List[str]:
    """The command-line texts to try; a tuple field gets each bad value in each position."""
    values = [as_text(v) for v in outside_values(bounds, kind)]
    if item_type(field_types(cls)[name]) is None:
        return values
    default = list(cls.__dataclass_fields__[name].default)
    return [str(tuple(default[:i] + [v] + default[i + 1:])).replace("'", "")
            for v in values for i in range(len(default))]


@pytest.mark.filterwarnings("ignore:.*(no effect|only checked)")  # metaseq-only flags, swept like the others
def test_every_numeric_train_flag_out_of_range_is_refused_at_parse_time(tmp_path):
    base = [str(tmp_path / "data"), "--max-update", "100", "--save-dir", str(tmp_path / "ckpt")]
    tally, configs = Tally(), 0
    for cls, select in train_configs():
        parse_train_config(base + select)  # the selection alone is valid: a refusal below is the value's
        configs += 1
        for f in fields(cls):
            kind = numeric_kind(field_types(cls)[f.name])
            if kind is None:
                continue
            tally.fields += 1
            bounds = field_bounds(cls, f.name)
            if not bounds:
                tally.exempt.append((cls.__name__, f.name))
            for text in field_values(cls, f.name, kind, bounds):
                try:
                    parse_train_config(base + select + [flag(f.name), text])
                    message = None
                except UsageError as error:
                    message = str(error)
                tally.check(f"{cls.__name__}.{f.name} = {text}", message, flag(f.name))
    assert not tally.failures, "\n".join(tally.failures)
    assert {key: EXEMPT.get(key) for key in tally.exempt} == {key: reason for key, reason in EXEMPT.items()
                                                              if key[0] != "GenerationOptions"}
    assert not list(tmp_path.iterdir()) and not list(Path.cwd().iterdir())  # nothing written
    print(f"\nmseq train: {tally.fields} numeric fields in {configs} configs, {tally.values} values refused; "
          f"exempt: {sorted(tally.exempt)}")


def test_defaults_lie_in_their_declared_ranges():
    for cls, _ in train_configs():
        for f in fields(cls):
            kind = numeric_kind(field_types(cls)[f.name])
            default = f.default
            if kind is None or default is None:
                continue
            for value in default if isinstance(default, tuple) else (default,):
                assert inside(field_bounds(cls, f.name), value), f"{cls.__name__}.{f.name} = {value}"


def test_help_shows_each_range():
    from metaseq_ds.options import TrainArgumentParser

    text = " ".join(TrainArgumentParser(["/data", "--optimizer", "adam"]).format_help().split())
    for needle in ("peak learning rate; must be > 0", "sequences per micro-batch on each rank; must be >= 1",
                   "betas for Adam optimizer; each must be in [0, 1)", "--zero-stage", "must be in [0, 3]"):
        assert needle in text


@pytest.mark.parametrize("flag_name, value, expected", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_issue_examples_are_one_line_exit_2_through_the_cli(flag_name, value, expected, tmp_path):
    save_dir = tmp_path / "ckpt"
    result = CliRunner().invoke(app, ["train", str(tmp_path / "data"), "--save-dir", str(save_dir), flag_name, value])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"mseq train: error: {expected}\n"
    assert not save_dir.exists() and not list(Path.cwd().iterdir())


def test_issue_examples_through_the_console_script(tmp_path):
    for flag_name, value, expected in EXAMPLES[:2]:
        command = [sys.executable, "-m", "metaseq_ds.cli.main", "train", str(tmp_path / "data"), flag_name, value]
        result = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=120)
        assert result.returncode == 2 and result.stderr == f"mseq train: error: {expected}\n", result.stderr
        assert not list(Path.cwd().iterdir())  # no checkpoints/, no data/, no log


# -- the other commands ---------------------------------------------------------------------------------

def invoke(args: List[str]) -> Tuple[int, Optional[str]]:
    """Exit code and the error line (None if the command did not fail with one line and no traceback)."""
    result = CliRunner().invoke(app, args)
    lines = result.stderr.splitlines()
    one_line = len(lines) == 1 and lines[0].startswith("mseq ") and "Traceback" not in result.output
    return result.exit_code, lines[0] if one_line else None


def sweep_command(tally: Tally, command: List[str], source: str, name: str, kind: type, bounds, extra=()) -> None:
    option = "--" + name.replace("_", "-")
    tally.fields += 1
    if not bounds:
        tally.exempt.append((source, name))
    for value in outside_values(bounds, kind):
        code, line = invoke(command + [option, as_text(value), *extra])
        tally.check(f"{' '.join(command[:2])} {option} {as_text(value)}", line if code == 2 else None, option)


def numeric_options(command, path: Tuple[str, ...] = ()) -> Iterator[Tuple[str, str]]:
    """(command, option) of every int/float option of the CLI (train's flags are its own parser's)."""
    if hasattr(command, "commands"):  # a group
        for name, sub in command.commands.items():
            if name != "train":
                yield from numeric_options(sub, path + (name,))
        return
    hints = typing.get_type_hints(command.callback)
    for param in command.params:
        if param.opts[0].startswith("-") and numeric_kind(hints[param.name]) is not None:
            yield " ".join(path), max(param.opts, key=len)


def test_every_numeric_option_of_the_other_commands_out_of_range_is_refused_first(tmp_path):
    missing = str(tmp_path / "no_checkpoint")  # refused before a checkpoint is looked for
    source = tmp_path / "plugin.py"
    source.write_text("from fairseq.models import FairseqDecoder\n")
    tally, swept = Tally(), set()
    for name, info in GenerationOptions.model_fields.items():
        kind = numeric_kind(info.annotation)
        if kind is not None:
            sweep_command(tally, ["generate", "--path", missing, "a prompt"], "GenerationOptions", name, kind,
                          [m for m in info.metadata if isinstance(m, Bound)])
            swept.add(("generate", flag(name)))
    for name in ("batch_size", "max_valid_steps"):
        sweep_command(tally, ["validate", "--path", missing], "DatasetConfig", name, int, field_bounds(DatasetConfig, name))
        swept.add(("validate", flag(name)))
    sweep_command(tally, ["migrate", str(source)], "MigrateOptions", "jobs", int, field_bounds(MigrateOptions, "jobs"))
    swept.add(("migrate", "--jobs"))
    serve_numbers = {"port": int, "max_batch_tokens": int, "max_request_bytes": int, "max_model_len": int,
                     "max_queued_requests": int, "request_timeout": float}
    for name, kind in serve_numbers.items():  # refused before a port is bound
        sweep_command(tally, ["serve", "--path", missing], "ServeOptions", name, kind, field_bounds(ServeOptions, name))
        swept.add(("serve", flag(name)))
    for name in ("ranks", "tensor_parallel_size", "zero_stage"):  # refused before the checkpoint is looked for
        sweep_command(tally, ["reshard", missing, str(tmp_path / "out")], "TargetLayout", name, int,
                      field_bounds(TargetLayout, name), extra=[] if name == "ranks" else ["--ranks", "2"])
        swept.add(("reshard", flag(name)))
    sweep_command(tally, ["preprocess", str(tmp_path / "no_data")], "PreprocessOptions", "workers", int,
                  field_bounds(PreprocessOptions, "workers"))
    swept.add(("preprocess", "--workers"))
    assert swept == set(numeric_options(typer.main.get_command(app)))  # import has none; export's size is text
    assert not tally.failures, "\n".join(tally.failures)
    assert {key: EXEMPT.get(key) for key in tally.exempt} == {("GenerationOptions", "length_penalty"):
                                                              EXEMPT[("GenerationOptions", "length_penalty")]}
    assert source.read_text() == "from fairseq.models import FairseqDecoder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plugin.py"] and not list(Path.cwd().iterdir())
    print(f"\nmseq generate/validate/migrate/serve/reshard/preprocess: {tally.fields} numeric options, {tally.values} values refused")


@pytest.mark.parametrize("size", ["0", "0GB", "0.0001KB", "-1", "-1GB"])
def test_export_refuses_an_empty_shard_size_before_writing(size, tmp_path):
    out = tmp_path / "out"
    code, line = invoke(["export", "hf", str(tmp_path / "no_checkpoint"), str(out), "--max-shard-size", size])
    assert code == 2 and line is not None and line.startswith("mseq export hf: error: --max-shard-size"), line
    assert not out.exists()
