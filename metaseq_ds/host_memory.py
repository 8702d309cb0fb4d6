"""How a rank's process uses the C library's heap (glibc), where CPU ranks keep their tensors.

    fix_mmap_threshold()   # once, as the process starts (distributed.utils.prepare_environment)
    release_freed_heap(device)   # after each optimizer step (Trainer.train_step); CPU ranks only

ZeRO-3 gathers and frees every layer's parameters (and their gradients) each step. glibc raises
its mmap threshold to the size of each freed block (up to 32 MB), so those tensors would come
to live in its heap, which it rarely gives back: measured on the 707M model, ZeRO-3 on 2 ranks
held 1.4 GiB more per rank after two steps (benchmarks/scale_memory.py). A fixed threshold of
`MMAP_THRESHOLD_BYTES` stops that drift: larger tensors get their own memory maps, returned
when freed, and smaller ones (activations, small parameters) still reuse the heap.

The heap still keeps what those smaller tensors free: a step's transients leave holes that stay
resident, and the next step's peak is that high-water mark plus whatever does not fit the
holes. `release_freed_heap` (`malloc_trim(0)`) returns the free pages of those holes after each
update; what the next step reuses faults back in. It is the host heap's counterpart of
`torch.cuda.empty_cache()`, and cheap: 9-30 ms an update on the 4-rank run below. On the 707M
model of `benchmarks/scale_memory.py` on 4 ranks (TP=2 x DP=2, ZeRO-3) a rank holds 0.11 GiB less
between steps and 0.02-0.03 GiB less at its peak. On GPU ranks tensors live in the device's
caching allocator, so the trainer releases the heap on CPU devices only.

Where the C library is not glibc (musl, macOS) both do nothing.
"""

import ctypes
import ctypes.util
import functools
from typing import Optional

from metaseq_ds.private_apis.verified import relies_on

# Allocations above this size get their own memory map, returned to the OS when freed.
MMAP_THRESHOLD_BYTES = 4 * 2**20
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


@functools.cache
def _libc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


@relies_on("glibc", "malloc's dynamic mmap threshold (mallopt M_MMAP_THRESHOLD)", written_for="2.36", cuda=False,
           private=False, test="tests/test_host_memory.py::test_release_freed_heap_gives_free_heap_pages_back",
           why="glibc raises its mmap threshold to each freed block's size (up to 32 MB), so ZeRO-3's gathered "
               "parameters come to live in a heap it rarely returns (+1.4 GiB a rank at 707M); CPU ranks only")
def fix_mmap_threshold() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES (no dynamic raise)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


@relies_on("glibc", "malloc_trim(0) returning the heap's free pages", written_for="2.36", cuda=False,
           private=False, test="tests/test_host_memory.py::test_release_freed_heap_gives_free_heap_pages_back",
           why="a step's transients leave free holes in glibc's heap that stay resident (malloc_trim, as suggested in"
               " https://github.com/pytorch/pytorch/issues/41486); CPU ranks only (GPU tensors live in the caching "
               "allocator)")
def release_freed_heap(device) -> bool:
    """Give the heap's free pages back to the system, on a rank whose tensors are on the CPU
    (`device`); whether it did. A GPU rank's heap holds no step's tensors: nothing to do."""
    if getattr(device, "type", device) != "cpu":  # a torch.device or its name
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(ctypes.c_size_t(0))
    return True
