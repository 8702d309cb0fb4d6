"""`GenerationOptions`: the one sampling configuration of `mseq generate`, `GeneratorInterface`
and `SequenceGenerator` (and, later, the HTTP server).

Built once where the values enter (the typer command, the keyword adapters of
`GeneratorInterface.generate` and `SequenceGenerator`, a request), checked once here, then
passed down unchanged: it is frozen. Each field holds its one default, its allowed range and a
description; `mseq generate --help` is built from them, and so is the one-line error:

    options = GenerationOptions.from_values({"top_p": 1.5}, name=lambda field: "--" + field.replace("_", "-"))
    # OptionError: --top-p must be in (0, 1], got 1.5   (error.field == "top_p")

`name` turns a field into what the caller calls it (a flag, a keyword, a JSON field), so the
CLI, metaseq's keyword names and an HTTP 400 all name what the user typed. The module
imports pydantic only: `mseq --help` reads it without torch.
"""

from typing import Any, Callable, Mapping, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from metaseq_ds.dataclass import constraints
from metaseq_ds.errors import UsageError

Namer = Callable[[str], str]
StopItem = Union[str, int, Tuple[int, ...]]

# Not a sampling option but how the decoding runs: `mseq generate`'s and `mseq serve`'s flag.
COMPILE_HELP = ("compile the decoding step (a CUDA graph on CUDA; inductor on the CPU, where compiling takes "
                "seconds per batch size); default: on CUDA only")

# The cross-field rule "a <= b", raised with the two field names so that the message can name
# them as the caller does.
ORDER_ERROR = "option_order"


class OptionError(UsageError):
    """A bad generation option: one line naming it; `field` is the GenerationOptions field
    (what an HTTP 400 reports as the bad parameter)."""

    def __init__(self, message: str, field: Optional[str]):
        super().__init__(message)
        self.field = field


class GenerationOptions(BaseModel):
    """How to complete prompts. Descriptions may name other fields as `{field}`: `describe`
    fills in the caller's names for them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(32, ge=1, description="at most N new tokens per completion")
    min_tokens: int = Field(0, ge=0, description="at least N new tokens before </s> or a stop may end it")
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False,
                               description="sampling temperature; 0 is greedy (beam search with {best_of} > 1)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the most probable tokens up to this mass")
    top_k: int = Field(0, ge=0, description="sample among the K most probable tokens (0: all)")
    n: int = Field(1, ge=1, description="completions per prompt")
    best_of: Optional[int] = Field(None, ge=1, description="generate this many (samples, or beams at temperature 0), "
                                                           "return the best {n} (default: {n})")
    logprobs: int = Field(0, ge=0, description="report the K most likely tokens at each position")
    echo: bool = Field(False, description="include (and score) the prompt in the output")
    # Token ids (int, or a sequence of them) may stop too: from Python and, later, HTTP.
    stop: Tuple[StopItem, ...] = Field((), description="stop at these strings (each may span tokens; not in the output)")
    # torch seeds take 64 bits; the ranks of a sharded model share rank 0's seed as an int64.
    seed: Optional[int] = Field(None, ge=0, lt=2**63, description="seed for reproducible sampling")
    length_penalty: float = Field(1.0, allow_inf_nan=False, description="beam scores are divided by length ** this")

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value  # OpenAI's `stop` may be one string

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, stop: Tuple[StopItem, ...]) -> Tuple[StopItem, ...]:
        for item in stop:
            if isinstance(item, str) and not item:
                raise ValueError("an empty stop string would stop at once")
            if isinstance(item, tuple) and not item:
                raise ValueError("an empty stop token sequence would stop at once")
        return stop

    @model_validator(mode="before")
    @classmethod
    def _best_of_defaults_to_n(cls, values: Any) -> Any:
        if isinstance(values, Mapping) and values.get("best_of") is None:
            return {**values, "best_of": values.get("n", cls.model_fields["n"].default)}
        return values

    @model_validator(mode="after")
    def _ordered(self) -> "GenerationOptions":
        for smaller, larger in (("min_tokens", "max_tokens"), ("n", "best_of")):
            if getattr(self, smaller) > getattr(self, larger):
                raise PydanticCustomError(ORDER_ERROR, "need {smaller} <= {larger}",
                                          {"smaller": smaller, "larger": larger,
                                           "values": (getattr(self, smaller), getattr(self, larger))})
        return self

    @property
    def beams(self) -> int:
        """Beams of a beam search: `best_of` at temperature 0, else 1 (sampling)."""
        return self.best_of if self.temperature == 0 else 1

    @property
    def samples(self) -> int:
        """Independent samples per prompt: `best_of` when sampling, else 1."""
        return 1 if self.temperature == 0 else self.best_of

    @classmethod
    def from_values(cls, values: Mapping[str, Any], name: Namer = str) -> "GenerationOptions":
        """Validated options from field values; a bad one raises `OptionError` naming it by `name`."""
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise explain(error, name) from None

    def replace(self, **changes: Any) -> "GenerationOptions":
        """A validated copy with some fields changed (`model_copy` would not check them)."""
        return type(self).from_values({**self.model_dump(), **changes})

    @classmethod
    def describe(cls, field: str, name: Namer = str) -> str:
        """One line of help: the description, fields named by `name`, and the allowed range."""
        info = cls.model_fields[field]
        text = info.description.format(**{other: name(other) for other in cls.model_fields})
        allowed = allowed_range(field)
        return f"{text}; must be {allowed}" if allowed else text


def allowed_range(field: str) -> Optional[str]:
    """'>= 0', 'in (0, 1]', ... from the field's constraints; None when any value goes."""
    return constraints.allowed_range(GenerationOptions.model_fields[field].metadata)


def explain(error: ValidationError, name: Namer = str) -> OptionError:
    """The first problem of a failed validation as one line, fields named by `name`."""
    problem = error.errors()[0]
    kind, context = problem["type"], problem.get("ctx", {})
    if kind == ORDER_ERROR:
        (smaller, larger), (small, large) = (context["smaller"], context["larger"]), context["values"]
        return OptionError(f"need {name(smaller)} <= {name(larger)}, got {name(smaller)}={small}, "
                           f"{name(larger)}={large}", smaller)
    field = str(problem["loc"][0]) if problem["loc"] else None
    where = name(field) if field else "generation options"
    got = problem["input"]
    if kind == "extra_forbidden":
        return OptionError(f"{where} is not a generation option", field)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
        return OptionError(constraints.out_of_range(where, GenerationOptions.model_fields[field].metadata, got,
                                                    finite=kind == "finite_number"), field)
    if kind == "value_error":
        return OptionError(f"{where}: {context['error']}", field)
    message = problem["msg"]
    return OptionError(f"{where}: {message[0].lower()}{message[1:]}, got {got!r}", field)

