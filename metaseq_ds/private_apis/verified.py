"""What each workaround relies on upstream, and the check that it still holds.

Every use of a private DeepSpeed or torch API, and every patch of upstream behaviour, is one
function under `@relies_on(...)`, which records:
- the package and what of it is relied on (a private name, or a behaviour worked around);
- the version it was written for: a private API stops with one line naming it on any other
  major.minor version (`METASEQ_DS_ALLOW_UNTESTED=1` tries anyway, with a warning), unless it
  has a public `fallback` doing the same more slowly, which then runs instead (warned once): a
  speed-up must not stop a run on another torch (the GPU machine's is 2.11);
- why, with the upstream issue where one exists: what would have to change upstream for the
  workaround to go;
- whether it applies on CUDA (several exist for gloo, glibc or the CPU accelerator only);
- the test that fails when upstream changes or fixes the behaviour relied on, and, for a
  behaviour worked around, a canary: a line of upstream's source that shows it, checked by
  `tests/test_private_apis.py` (when it is gone, upstream changed: see whether the workaround can go).

`RELIED_ON` holds every record once its module is imported; `tests/test_private_apis.py` imports
each such module and checks that every record names a test that exists.
"""

import functools
import os
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Dict, Optional, Tuple

from metaseq_ds.errors import UsageError

ALLOW_UNTESTED = "METASEQ_DS_ALLOW_UNTESTED"


@dataclass(frozen=True)
class Reliance:
    name: str  # the function, module-qualified
    package: str  # "deepspeed", "torch" or "glibc" (a glibc behaviour is public: never gated)
    what: str  # the private API or the behaviour relied on
    written_for: str  # major.minor of the package
    cuda: bool  # whether it is used on CUDA devices
    why: str  # the reason, and the upstream issue or change that would let it go
    test: str  # "tests/FILE.py::TEST": fails when upstream changes what this relies on
    private: bool = True  # a private API (version-gated), else a public one worked around
    canaries: Tuple[Tuple[str, str], ...] = ()  # (upstream module, a line of its source that shows the behaviour)
    fallback: str = ""  # what runs instead on an untested version (the fallback's first docstring line)


RELIED_ON: Dict[str, Reliance] = {}


def relies_on(package: str, what: str, *, written_for: str, cuda: bool, why: str, test: str,
              private: bool = True, canaries: Tuple[Tuple[str, str], ...] = (),
              fallback: Optional[Callable] = None) -> Callable[[Callable], Callable]:
    """Record a workaround (see the module docstring); a private API's version is checked at each call.
    `fallback`: a public function taking the same arguments, run instead on an untested version."""
    instead = (fallback.__doc__ or fallback.__name__).strip().splitlines()[0] if fallback else ""

    def record(function: Callable) -> Callable:
        name = f"{function.__module__}.{function.__qualname__}"
        RELIED_ON[name] = Reliance(name, package, what, written_for, cuda, why, test, private, canaries, instead)
        if not private:
            return function

        @functools.wraps(function)
        def checked(*args, **kwargs):
            if fallback is not None:
                return (function if use_private(package, what, written_for, instead) else fallback)(*args, **kwargs)
            require_tested(package, what, written_for)
            return function(*args, **kwargs)

        return checked

    return record


def _refusal(package: str, api: str, written_for: str) -> Optional[str]:
    """None where the private `api` may run: on the major.minor version it was written for, or,
    warned, with ALLOW_UNTESTED set; else why not, in words."""
    version = metadata.version(package)
    if ".".join(version.split(".")[:2]) == written_for:
        return None
    message = (f"metaseq_ds relies on {package}'s private {api}, written for {package} {written_for}.x; "
               f"this is {package} {version}")
    if os.environ.get(ALLOW_UNTESTED):
        warnings.warn(message + f" ({ALLOW_UNTESTED} is set: trying anyway)", stacklevel=5)
        return None
    return message


@functools.lru_cache(maxsize=None)
def require_tested(package: str, api: str, written_for: str) -> None:
    """Stop with one line when `package` is not the major.minor version `api` was written for."""
    message = _refusal(package, api, written_for)
    if message is not None:
        raise UsageError(f"{message}: install a verified version, or set {ALLOW_UNTESTED}=1 to try anyway")


@functools.lru_cache(maxsize=None)
def use_private(package: str, api: str, written_for: str, instead: str) -> bool:
    """Whether to call the private `api`; where not, its public fallback runs, `instead`, with one
    warning a process."""
    message = _refusal(package, api, written_for)
    if message is not None:
        warnings.warn(f"{message}: using {instead} instead (set {ALLOW_UNTESTED}=1 to try the private API)", stacklevel=4)
    return message is None
