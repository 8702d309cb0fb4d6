"""What `mseq serve` was asked to do, with the allowed range of each number declared once: the
check before any work (`validate`), `--help` and the one-line error read the same declaration.
Imports pydantic only, so that `mseq --help` stays free of torch and the web stack."""

from dataclasses import dataclass, fields
from typing import Annotated, Literal, Optional

from pydantic import Field

from metaseq_ds.dataclass.constraints import PositiveInt


@dataclass
class ServeOptions:
    path: str
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 6010  # 0: any free port
    api_key: Optional[str] = None
    # A batch's KV cache positions: sequences x (longest prompt + most new tokens).
    max_batch_tokens: Annotated[PositiveInt, Field(lt=2**31)] = 16384
    # Below 1 KiB no real request fits; above 1 GiB one body could hold the server's memory.
    max_request_bytes: Annotated[int, Field(ge=1024, le=2**30)] = 2**20
    compile: Optional[bool] = None  # the decoding step's (None: on CUDA only)
    # continuous: sequences join and leave the batch at every step; static: a batch decodes to
    # its end before the next starts; one: one request at a time (both static: for comparison,
    # and what launches of several ranks use).
    batching: Literal["continuous", "static", "one"] = "continuous"
    # Positions per sequence (prompt + new tokens): the KV cache holds --max-batch-tokens of them,
    # so fewer positions make room for more sequences at once. None: the model's.
    max_model_len: Optional[Annotated[int, Field(ge=2)]] = None
    # Requests queued beyond these are answered 429: a burst waits, a flood is told to come back.
    max_queued_requests: Annotated[PositiveInt, Field(le=1_000_000)] = 1024
    # Seconds from arrival to the last token; later is a 504 (and the request stops decoding).
    request_timeout: Annotated[float, Field(gt=0, le=86_400)] = 600.0

    def validate(self) -> None:
        """Every number in its range, else `UsageError` naming the flag."""
        from metaseq_ds.dataclass import validate_value

        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if name in ("path", "host", "api_key", "compile") or value is None:
                continue
            validate_value(ServeOptions, name, value, "--" + name.replace("_", "-"))
