"""`MetaseqDataclass`: the base of every config section, and of plugin configs.

A config is a standard-library dataclass whose fields carry their help text in
`metadata={"help": ...}`, exactly as fairseq and metaseq wrote them, so plugin configs
keep working unmodified. A field's allowed range is part of its type
(`Annotated[int, Field(ge=1)]`, see `constraints`). Validation (types, choices, ranges,
coercion of command-line strings) is pydantic's, applied in one place: `validate_config`.
"""

import dataclasses
from enum import Enum
from typing import Any, ClassVar, Dict, Mapping, Optional, Type, TypeVar

import pydantic

from metaseq_ds.dataclass.constraints import bounds, field_types, item_type, out_of_range
from metaseq_ds.errors import UsageError

C = TypeVar("C", bound="MetaseqDataclass")


@dataclasses.dataclass
class MetaseqDataclass:
    """Base config: fields with `metadata={"help": ...}` become `--flag-name` options."""

    # The registry name of the component this config belongs to (set by register_*).
    _name: ClassVar[Optional[str]] = None
    # pydantic's settings for every config, plugins' too: a NaN or infinite value is never meant.
    __pydantic_config__ = pydantic.ConfigDict(allow_inf_nan=False)

    @classmethod
    def field_help(cls, name: str) -> str:
        return cls.__dataclass_fields__[name].metadata.get("help", "")

    def to_dict(self) -> Dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_read_only", False):
            raise AttributeError(
                f"{type(self).__name__}.{name}: the config is read-only once validated; set it with its flag, "
                f"or derive a new config (dataclasses.replace, metaseq_ds.options.resolve)")
        object.__setattr__(self, name, value)


def make_read_only(config: MetaseqDataclass) -> None:
    """From now on, assigning a field of `config` raises (a validated config is never mutated)."""
    object.__setattr__(config, "_read_only", True)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value


class _StrEnumMeta(type(Enum)):
    def __contains__(cls, item):  # `"adam" in MyChoices` as fairseq code does
        return item in cls.__members__.values() or item in [m.value for m in cls]


class StrEnum(str, Enum, metaclass=_StrEnumMeta):
    def __str__(self) -> str:
        return self.value

    def __eq__(self, other) -> bool:
        return self.value == (other.value if isinstance(other, Enum) else other)

    def __hash__(self) -> int:
        return hash(self.value)


def ChoiceEnum(choices):
    """fairseq's helper: an Enum of string choices usable as a field type."""
    return StrEnum("Choices", {k: k for k in choices})


_ADAPTERS: Dict[type, pydantic.TypeAdapter] = {}


def validate_config(cls: Type[C], values: Mapping[str, Any], flag_of=lambda name: name) -> C:
    """Build `cls` from `values` (strings from the command line are coerced).

    Errors become one UsageError naming the flag (via `flag_of`) and what is allowed.
    """
    unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise UsageError(f"{cls.__name__} has no field {sorted(unknown)[0]!r}")
    if cls not in _ADAPTERS:
        _ADAPTERS[cls] = pydantic.TypeAdapter(cls)
    try:
        return _ADAPTERS[cls].validate_python(dict(values))
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        if not first["loc"]:  # raised by the config's own checks: its message says it all
            raise UsageError(str(first.get("ctx", {}).get("error", first["msg"]))) from None
        raise UsageError(_explain(cls, first, flag_of)) from None
    except ValueError as error:  # raised by a config's __post_init__ checks
        raise UsageError(str(error)) from None


def validate_value(cls: type, name: str, value: Any, flag: str) -> Any:
    """One value checked against the type and range of `cls`'s field `name`, as `validate_config`
    checks it: for a command's option that mirrors a config field (`mseq validate --batch-size`)."""
    annotation = field_types(cls)[name]
    try:
        return pydantic.TypeAdapter(annotation, config=pydantic.ConfigDict(allow_inf_nan=False)).validate_python(value)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        raise UsageError(_explain_value(annotation, first, flag, item=bool(first["loc"]))) from None


RANGE_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number")


def _explain(cls: type, error: Mapping[str, Any], flag_of) -> str:
    """One line for pydantic's first error: the flag, the value and what is allowed."""
    name = str(error["loc"][0])
    return _explain_value(field_types(cls)[name], error, flag_of(name), item=len(error["loc"]) > 1)


def _explain_value(annotation: Any, error: Mapping[str, Any], where: str, item: bool) -> str:
    got = error.get("input")
    if error["type"] in RANGE_ERRORS:
        if item and item_type(annotation) is not None:  # an item of a tuple/list field
            annotation, where = item_type(annotation), f"each value of {where}"
        return out_of_range(where, bounds(annotation), got, finite=error["type"] == "finite_number")
    return f"invalid value {got!r} for {where}: {_reason(error)}"


def _reason(error: Mapping[str, Any]) -> str:
    msg = error["msg"]
    return msg[0].lower() + msg[1:] if msg else error["type"]
