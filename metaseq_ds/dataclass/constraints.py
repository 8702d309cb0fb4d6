"""Allowed ranges of config values, declared once on the field's type.

pydantic reads the declaration (the check at parse time), `--help` shows it and the error
message names it, so the three never disagree:

    lr: Annotated[float, Field(gt=0)] = field(default=0.25, metadata={"help": "peak learning rate"})
    # mseq train --help:   --lr LR   peak learning rate; must be > 0 [default: 0.25]
    # mseq train --lr -1:  mseq train: error: --lr must be > 0, got -1

A plain `Annotated` type keeps a config an ordinary standard-library dataclass (fairseq-style
plugin configs stay as they are; a plugin that wants a range declares it the same way, with
pydantic's `Field` or `annotated_types`). Constraint keys in `metadata` would have worked too,
but then pydantic would not see them: a second checker would have to apply them, nested types
(`Tuple[Beta, Beta]`, `Optional[...]`) would need their own rules, and type checkers and IDEs
would not show them. Non-finite floats are refused in every config (`MetaseqDataclass`).

This module imports pydantic only: `mseq --help` reads it without torch.
"""

import dataclasses
import functools
import typing
from typing import Annotated, Any, List, Optional, Sequence

import annotated_types
from pydantic import Field
from pydantic.fields import FieldInfo

# The ranges most fields share.
PositiveInt = Annotated[int, Field(ge=1)]  # counts, sizes, intervals
NonNegativeInt = Annotated[int, Field(ge=0)]  # counts where 0 means "none" or "off"
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
DropoutProbability = Annotated[float, Field(ge=0, lt=1)]  # 1 would zero every activation
# torch seeds take 64 bits; seeds reach torch as int64 (`torch.manual_seed`, broadcasts).
Seed = Annotated[int, Field(ge=0, lt=2**63)]

Bound = (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt)


def bounds(annotation: Any) -> List[Any]:
    """The range constraints (annotated_types' Ge/Gt/Le/Lt) of a type, through `Optional[...]`."""
    found: List[Any] = []
    for item in _annotated_metadata(strip_optional(annotation)):
        if isinstance(item, FieldInfo):
            found.extend(m for m in item.metadata if isinstance(m, Bound))
        elif isinstance(item, annotated_types.GroupedMetadata):  # e.g. annotated_types.Interval
            found.extend(m for m in item if isinstance(m, Bound))
        elif isinstance(item, Bound):
            found.append(item)
    return found


def item_type(annotation: Any) -> Optional[Any]:
    """The element type of a tuple or list type (their items carry the range), else None."""
    base = plain_type(annotation)
    if typing.get_origin(base) in (tuple, list):
        args = [a for a in typing.get_args(base) if a is not Ellipsis]
        return args[0] if args else None
    return None


def plain_type(annotation: Any) -> Any:
    """The type without `Optional[...]` and `Annotated[...]`: what decides how a flag is parsed."""
    base = strip_optional(annotation)
    return typing.get_args(base)[0] if typing.get_origin(base) is Annotated else base


def strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _annotated_metadata(annotation: Any) -> Sequence[Any]:
    return annotation.__metadata__ if typing.get_origin(annotation) is Annotated else ()


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> typing.Dict[str, Any]:
    """Each field's type with its `Annotated` constraints, also under `from __future__ import annotations`."""
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):  # a hint that does not resolve here: the declared types as they are
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def field_bounds(cls: type, name: str) -> List[Any]:
    """The range of a dataclass field, or of its items for a tuple/list field."""
    annotation = field_types(cls)[name]
    items = item_type(annotation)
    return bounds(items) if items is not None else bounds(annotation)


def allowed_range(constraints: Sequence[Any]) -> Optional[str]:
    """'>= 0', 'in (0, 1]', ... from range constraints; None when any value goes."""
    lower = upper = None
    for constraint in constraints:
        if isinstance(constraint, annotated_types.Ge):
            lower = ("[", ">=", constraint.ge)
        elif isinstance(constraint, annotated_types.Gt):
            lower = ("(", ">", constraint.gt)
        elif isinstance(constraint, annotated_types.Le):
            upper = ("]", "<=", constraint.le)
        elif isinstance(constraint, annotated_types.Lt):
            upper = (")", "<", constraint.lt)
    if lower and upper:
        return f"in {lower[0]}{_number(lower[2])}, {_number(upper[2])}{upper[0]}"
    bound = lower or upper
    return f"{bound[1]} {_number(bound[2])}" if bound else None


def _number(value) -> str:
    return "2**63" if value == 2**63 else str(value)  # the seed's bound reads better than its 19 digits


def describe_range(cls: type, name: str) -> str:
    """What `--help` appends to a field's description: '; must be >= 1' (empty without a range)."""
    allowed = allowed_range(field_bounds(cls, name))
    if allowed is None:
        return ""
    return f"; {'each ' if item_type(field_types(cls)[name]) is not None else ''}must be {allowed}"


def out_of_range(name: str, constraints: Sequence[Any], got: Any, finite: bool = False) -> str:
    """The one-line error for a value outside its range (or not finite): '--lr must be > 0, got -1'."""
    allowed = allowed_range(constraints)
    shown = got if isinstance(got, str) else repr(got)  # a command-line string as typed
    if finite:
        return f"{name} must be a finite number{' ' + allowed if allowed else ''}, got {shown}"
    return f"{name} must be {allowed}, got {shown}"
