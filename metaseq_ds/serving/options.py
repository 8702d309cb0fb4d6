"""What `mseq serve` was asked to do, with the allowed range of each number declared once: the
check before any work (`validate`), `--help` and the one-line error read the same declaration.
Imports pydantic only, so that `mseq --help` stays free of torch and the web stack."""

from dataclasses import dataclass, fields
from typing import Annotated, Optional

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

    def validate(self) -> None:
        """Every number in its range, else `UsageError` naming the flag."""
        from metaseq_ds.dataclass import validate_value

        for name in (f.name for f in fields(self)):
            if isinstance(getattr(self, name), int) and not isinstance(getattr(self, name), bool):
                validate_value(ServeOptions, name, getattr(self, name), "--" + name.replace("_", "-"))
