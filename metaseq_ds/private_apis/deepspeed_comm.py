"""DeepSpeed's communication backend and its CPU accelerator's shared-memory all-reduce (deepspeed 0.19)."""

import os
from pathlib import Path
from typing import Any, Callable

from metaseq_ds.private_apis.verified import relies_on


@relies_on("deepspeed", "the name of csrc/cpu/comm/shm.cpp's all-reduce buffer",
           written_for="0.19", cuda=False,
           why="DeepSpeed's CPU shared-memory all-reduce never unlinks its ~66 MB /dev/shm buffer per rank (shm.cpp's"
               " shared_close is never called; https://github.com/deepspeedai/DeepSpeed/pull/4115 notes it stays "
               "after exit); we unlink it once every rank has mapped it. CPU accelerator only",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def shm_allreduce_buffer(rank: int) -> Path:
    """The file in /dev/shm that DeepSpeed's shared-memory all-reduce op (`csrc/cpu/comm/shm.cpp`,
    built and initialised by `deepspeed.init_distributed()` when all ranks share one machine)
    creates for `rank`: ~66 MB, named from the user, MASTER_ADDR and MASTER_PORT, and never
    unlinked by DeepSpeed. Each rank creates its own and maps every other rank's while it
    initialises; after that no rank opens one by name again."""
    address, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{address}_{port}_{rank}"


@relies_on("deepspeed", "the CPU accelerator's device_count(): LOCAL_SIZE when set, else `numactl --hardware` run anew",
           written_for="0.19", cuda=False, private=False,
           why="without LOCAL_SIZE (set by DeepSpeed's launcher only) every device_count() on the CPU accelerator "
               "starts a numactl process, and ZeRO-3 asks once for each gradient bucket it reduces "
               "(__avg_scatter_grads): 290 processes a step at 24 layers, half a one-process ZeRO-3 step's host time. "
               "CPU accelerator only",
           test="tests/test_private_apis.py::test_cpu_ranks_count_local_ranks_without_starting_numactl",
           canaries=(("deepspeed.accelerator.cpu_accelerator", "device_count = int(os.environ.get('LOCAL_SIZE', 0))"),))
def count_local_ranks_without_numactl() -> None:
    """Tell DeepSpeed's CPU accelerator how many ranks this machine runs (LOCAL_SIZE, as its own
    launcher does) from torchrun's or our rendezvous' LOCAL_WORLD_SIZE, where no launcher set it."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])


@relies_on("deepspeed", "deepspeed.comm.comm.cdb's all_gather_function and reduce_scatter_function",
           written_for="0.19", cuda=False,
           why="gloo's all_gather_into_tensor and reduce_scatter_tensor copy their whole data once more "
               "(distributed.gloo_collectives); DeepSpeed has no public way to swap its collectives. Installed for "
               "gloo only: NCCL works in place",
           test="tests/test_gloo_collectives.py::test_in_place_gloo_collectives_equal_torchs_and_deepspeed_reaches_them")
def route_deepspeed_collectives(all_gather_into_tensor: Callable[..., Any], reduce_scatter_tensor: Callable[..., Any]) -> None:
    """Make these (torch's signatures) the functions behind every all-gather and reduce-scatter of
    DeepSpeed's communication backend (`deepspeed.comm`'s `cdb.all_gather_function` and
    `cdb.reduce_scatter_function`, which ZeRO reaches through `dist.allgather_fn`,
    `dist.all_gather_into_tensor` and `dist.reduce_scatter_fn`). Initialises `deepspeed.comm` on
    the existing process group first if it is not yet. (Checked on 3 ranks by
    tests/test_gloo_collectives.py: DeepSpeed's entry points reach them.)"""
    import deepspeed
    from deepspeed.comm import comm

    if comm.cdb is None or not comm.cdb.is_initialized():
        deepspeed.init_distributed()
    comm.cdb.all_gather_function = all_gather_into_tensor
    comm.cdb.reduce_scatter_function = reduce_scatter_tensor
