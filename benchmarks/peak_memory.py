"""The one measure of peak memory every benchmark prints (beside its theory): CUDA's peak
allocated memory on a GPU, else the peak resident memory (RSS) of the process."""

import resource
from typing import Tuple


def peak_rss(usage=None) -> int:
    """Peak resident bytes of this process, or of the child whose `os.wait4` usage is given."""
    usage = usage if usage is not None else resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_maxrss * 1024  # Linux reports KiB


def peak_memory() -> Tuple[str, int]:
    """(kind, bytes) of this process's peak: CUDA's allocated memory on a GPU, else resident memory."""
    import torch

    if torch.cuda.is_available():
        return "CUDA allocated", torch.cuda.max_memory_allocated()
    return "RSS", peak_rss()
