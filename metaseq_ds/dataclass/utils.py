"""Config fields as command-line options: their names, their help, their values from text, and
fairseq's and metaseq's `gen_parser_from_dataclass` for parsers that scripts build themselves.

`mseq train` (`metaseq_ds.options`) adds each field as an option that keeps the text, and checks
all values together once the architecture's defaults are known; `gen_parser_from_dataclass`
adds options that parse and check each value on their own, with the config's values as their
defaults, as metaseq's did.
"""

import argparse
import ast
import dataclasses
import enum
import typing
from typing import Any, List, Optional

from metaseq_ds.dataclass.base import MetaseqDataclass, validate_value
from metaseq_ds.dataclass.constraints import describe_range, field_types, plain_type, strip_optional
from metaseq_ds.errors import UsageError


def flag(name: str) -> str:
    """A field's option: `max_update` -> `--max-update`."""
    return "--" + name.replace("_", "-")


def option_names(name: str) -> List[str]:
    """A field's option and its aliases."""
    if name == "local_rank":  # the deepspeed launcher passes --local_rank=N
        return [flag(name), "--local_rank"]
    return [flag(name)]


def field_help(cls: type, f: dataclasses.Field) -> str:
    """A field's `--help` text: its description, its allowed range and its choices."""
    text = f.metadata.get("help", "") + describe_range(cls, f.name)
    annotation = plain_type(field_types(cls)[f.name])
    if typing.get_origin(annotation) is typing.Literal:
        text += f" (one of: {', '.join(map(str, typing.get_args(annotation)))})"
    elif isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        text += f" (one of: {', '.join(str(m.value) for m in annotation)})"
    return text


def value_from_text(value: Any, annotation: Any) -> Any:
    """Command-line strings for tuples/lists/None become Python values; pydantic does the rest."""
    if not isinstance(value, str):
        return value
    if value in ("None", "none") and strip_optional(annotation) is not annotation:
        return None
    base = plain_type(annotation)
    if typing.get_origin(base) in (tuple, list, typing.Tuple, typing.List) or base in (tuple, list):
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = [part.strip() for part in value.split(",")]
        return list(parsed) if isinstance(parsed, (tuple, list)) else [parsed]
    return value


def gen_parser_from_dataclass(
    parser,
    dataclass_instance: MetaseqDataclass,
    delete_default: bool = False,
    with_prefix: Optional[str] = None,
) -> None:
    """Add an option to `parser` (an ArgumentParser or a group) for each field of `dataclass_instance`.

    `--field-name` (with `with_prefix="--encoder"`: `--encoder-field-name`), parsed and checked
    by the field's type and range, defaulting to the instance's value (none with
    `delete_default`); a field named `data` is the positional argument; a bool is a switch; a
    field holding a config adds that config's options (prefixed by its own name when there is a
    prefix). An option the parser has already is kept: fixed sections and components share
    `--seed`, `--batch-size`, `--lr`.
    """
    cls = type(dataclass_instance)
    for f in dataclasses.fields(cls):
        value = getattr(dataclass_instance, f.name)
        name = f"{with_prefix}-{f.name.replace('_', '-')}" if with_prefix else flag(f.name)
        if isinstance(value, MetaseqDataclass):
            gen_parser_from_dataclass(parser, value, delete_default, name if with_prefix else None)
            continue
        help_text = field_help(cls, f)
        kwargs = {"help": f"{with_prefix[2:]}: {help_text}" if with_prefix else help_text}
        if plain_type(field_types(cls)[f.name]) is bool:
            kwargs["action"] = "store_false" if value is True else "store_true"
        else:
            kwargs["type"] = _parse_value(cls, f.name, name)
            kwargs["metavar"] = f.name.upper()
        if not delete_default:
            kwargs["default"] = value
        names = [name] if with_prefix else option_names(f.name)
        if f.name == "data" and not with_prefix:  # fairseq's rule: the data directory is positional
            # argparse refuses a second option of one name, but would take a second positional
            if any(action.dest == "data" for action in parser._actions):
                continue
            names, kwargs["nargs"] = [f.name], "?"
            del kwargs["metavar"]
        try:
            parser.add_argument(*names, **kwargs)
        except argparse.ArgumentError:
            pass  # the parser has this option already: the first section to define it owns it


def _parse_value(cls: type, name: str, option: str):
    """argparse's `type` for a field: the text as the field's value, or an argparse error."""
    annotation = field_types(cls)[name]

    def parse(text: str) -> Any:
        try:
            return validate_value(cls, name, value_from_text(text, annotation), option)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return parse
