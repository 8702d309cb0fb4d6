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


def _keep_deepspeeds_references() -> None:
    """DeepSpeed's process-wide references, left in place (its groups then go as the interpreter finalises)."""


@relies_on("deepspeed", "the process-wide references to groups and modules: deepspeed.utils.groups' module-level "
           "groups and mesh, ZeRO-3's parameter_offload.FWD_MODULE_STACK and the lru_cache of "
           "PartitionedParameterCoordinator.__params_to_release",
           written_for="0.19", cuda=True, fallback=_keep_deepspeeds_references,
           why="a process group's threads stop only when its last reference goes; these references last as long as "
               "the process (ZeRO-3's module stack keeps the root module and its cache every coordinator and "
               "submodule, never cleared; the groups module caches groups), so the groups, and each ZeRO-3 "
               "engine, went during finalisation, where a gloo worker finishing its last work needs the GIL and "
               "aborts the process (exit -6 after a run that succeeded). Can go when DeepSpeed's engine.destroy() "
               "releases them",
           test="tests/test_process_group_exit.py::test_every_process_group_is_freed_before_the_interpreter_finalises",
           canaries=(("deepspeed.runtime.zero.parameter_offload", "FWD_MODULE_STACK.append(self.module)"),
                     ("deepspeed.runtime.zero.partitioned_param_coordinator", "@functools.lru_cache(maxsize=None)"),
                     ("deepspeed.utils.groups", "_WORLD_GROUP = dist.new_group(ranks=range(dist.get_world_size()))")))
def drop_deepspeeds_references() -> None:
    """Drop what DeepSpeed keeps for the life of the process that holds process groups: the groups
    (and device mesh) that `deepspeed.utils.groups` caches, and ZeRO-3's stack of modules in
    forward and cache of parameters to release, which hold modules whose parameters hold their
    groups. For a process that is done with distributed work: at its clean exit."""
    import torch.distributed as dist
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator
    from deepspeed.utils import groups

    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup) or name == "mesh_device":
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(group, dist.ProcessGroup) for group in value.values()):
            value.clear()
    parameter_offload.FWD_MODULE_STACK.clear()
    # instrument_w_nvtx wraps the cached method in a closure without functools.wraps
    instrumented = vars(partitioned_param_coordinator.PartitionedParameterCoordinator)[
        "_PartitionedParameterCoordinator__params_to_release"]
    cached = dict(zip(instrumented.__code__.co_freevars, (cell.cell_contents for cell in instrumented.__closure__)))["func"]
    cached.cache_clear()
