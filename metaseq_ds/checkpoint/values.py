"""A checkpoint's weights as the values of a model's parameters (`distributed.materialize`), each
rank reading only its part, tensor by tensor, and letting the file's pages go as it reads.
"""

import ctypes
import functools
import logging
import mmap
from typing import Any, Dict, Optional

import torch

from metaseq_ds.checkpoint.read import LazyConcat
from metaseq_ds.models.initialization import rank_part
from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)


class CheckpointValues:
    """A checkpoint's weights as parameter values for `distributed.materialize`, read tensor by
    tensor (`weights` maps each name to a lazily read tensor: `lazy_model_weights`, or the lazy
    safetensors of an HF folder, `convert.hf_import`), each rank taking only its part.

    A tensor-parallel save read at its own degree gives each rank its saved part directly. Saved
    vocabulary rows fewer than the model's (a larger tensor-parallel degree pads the vocabulary
    to a multiple of 8*N) are kept, and the new padding rows take their initial values.
    """

    def __init__(self, weights: Dict[str, Any], source: str, initial):
        self.weights, self.source, self.initial = weights, source, initial

    def shard(self, name: str, full_shape, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        saved = self.weights.get(name)
        if saved is None:
            raise UsageError(f"{self.source}: weight {name!r} is missing (a checkpoint of another model?)")
        value = self._part_of(saved, name, tuple(full_shape), dim, rank, size)
        # The part must not live in the checkpoint's file mapping (a parameter would keep those
        # pages in memory), and the pages read to make it are let go at once: only the rank's
        # parts accumulate, whatever the saved layout (a row-parallel slice reads every page).
        if file_mapped(value):
            value = value.clone()
        for tensor in saved.parts if isinstance(saved, LazyConcat) else [saved]:
            release_file_pages(tensor)
        return value

    def _part_of(self, saved, name: str, full_shape, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        from metaseq_ds.distributed.tensor_parallel import is_vocabulary_parameter

        saved_shape = tuple(saved.shape)
        if saved_shape == full_shape:
            if isinstance(saved, LazyConcat) and dim == saved.dim and len(saved.parts) == size:
                return saved.parts[rank].contiguous().float()  # saved at this tensor-parallel degree
            return rank_part(saved.contiguous().float(), dim, rank, size)
        if is_vocabulary_parameter(name) and saved_shape[1:] == full_shape[1:] and saved_shape[0] < full_shape[0]:
            grown = self.initial.whole(name, full_shape)
            grown[: saved_shape[0]] = saved.contiguous().float()
            logger.warning(f"{name}: {saved_shape[0]} saved vocabulary rows, {full_shape[0]} now; "
                           f"the {full_shape[0] - saved_shape[0]} new padding rows keep their initial values")
            return rank_part(grown, dim, rank, size)
        raise UsageError(f"{self.source}: weight {name} has shape {saved_shape}, this model {full_shape}")

    def check_all_used(self, parameter_names) -> None:
        unused = sorted(set(self.weights) - set(parameter_names))
        if unused:
            raise UsageError(f"{self.source}: weight {unused[0]!r} has no place in this model")


def file_mapped(tensor: Any) -> bool:
    """Whether `tensor`'s memory is a memory-mapped file's (`torch.load(mmap=True)`): torch does
    not say (`UntypedStorage.filename` is None for those), the process's memory map does."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return False
    address = tensor.data_ptr()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                if start <= address < end:
                    return len(fields) == 6 and fields[5].startswith("/")  # a path, not [heap] or anonymous
    except OSError:  # no /proc (not Linux): parts may stay in the mapping, nothing is released
        pass
    return False


def release_file_pages(tensor: Any) -> None:
    """Drop the pages of a file-mapped, never written `tensor` from this process's memory
    (madvise MADV_DONTNEED; they are read from the file again if touched). Other tensors are
    left alone: on anonymous memory that call would zero them."""
    if not file_mapped(tensor):
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED)


MADV_DONTNEED = 4  # Linux


@functools.lru_cache(maxsize=None)
def _libc():
    return ctypes.CDLL(None, use_errno=True)

