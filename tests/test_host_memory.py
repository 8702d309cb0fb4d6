"""`host_memory.release_freed_heap`: the heap's free pages go back to the system (glibc).

Run in a child process, whose heap holds nothing of the test session's."""

import subprocess
import sys

from launch import env

CHILD = """
import torch
from metaseq_ds.host_memory import release_freed_heap

def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20

# 64 MiB of 4 KiB tensors (below glibc's mmap threshold: in the heap), the last one kept, so
# freeing the others leaves holes below it that glibc cannot give back by shrinking the heap
held = [torch.ones(1024) for _ in range(16384)]
last = held.pop()
del held
before = resident_mib()
released = release_freed_heap(torch.device("cpu"))
print(released, before - resident_mib())
"""


def test_release_freed_heap_gives_free_heap_pages_back():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    released, freed_mib = out.stdout.split()
    assert released == "True"
    assert float(freed_mib) > 32  # most of the 64 MiB of holes
