"""What `mseq migrate` was asked to do. Apart from `runner` so that `mseq --help` reads the
options' ranges without importing libcst."""

from dataclasses import dataclass
from typing import Optional, Sequence

from metaseq_ds.dataclass.constraints import PositiveInt


@dataclass
class Options:
    paths: Sequence[str]
    diff: bool = False
    check: bool = False
    report: Optional[str] = None
    jobs: PositiveInt = 1
    exclude: Sequence[str] = ()
    shell: bool = False
