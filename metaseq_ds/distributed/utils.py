"""Start the process group the same way alone, under `deepspeed` and under `torchrun`, and
answer metaseq's rank queries.

A plain `mseq train` has no launcher and no cluster environment: it becomes a world of
one on 127.0.0.1 with a free port. Launchers set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*.
On a machine without CUDA, DeepSpeed's CPU accelerator is chosen and talks over gloo.

With tensor parallelism of degree N the ranks form a (data-parallel x tensor-parallel) grid,
Megatron's layout: ranks r..r+N-1 hold the N shards of one model replica. The groups are
DeepSpeed's (`deepspeed.utils.groups`), so the engine, which is handed them as its `mpu`,
reduces ZeRO's gradients over the data-parallel group only.
"""

import atexit
import gc
import os
import socket
import sys
from typing import List

import torch
import torch.distributed as dist

from metaseq_ds.host_memory import fix_mmap_threshold
from metaseq_ds.private_apis.deepspeed_comm import count_local_ranks_without_numactl, drop_deepspeeds_references


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def prepare_environment(distributed_port: int = -1) -> None:
    """Fill in a single-process rendezvous when no launcher did, and pick the accelerator."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port if distributed_port > 0 else _free_port()))
    if torch.cuda.is_available():
        # Before anything is made on "cuda": each rank's tensors (a model materialised from a
        # checkpoint, NCCL's buffers) on its own GPU, never all on GPU 0.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        count_local_ranks_without_numactl()
        fix_mmap_threshold()  # host_memory (CPU ranks): ZeRO's gathered tensors must not stay in glibc's heap
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU must split its cores, or they slow each other down 2-7x.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))


def init_distributed(distributed_port: int = -1, tensor_parallel_size: int = 1) -> None:
    prepare_environment(distributed_port)
    if not dist.is_initialized():
        import deepspeed

        start_process_group()
        if deepspeed.get_accelerator().device_name() == "cpu":
            release_shm_buffer()  # the buffer of DeepSpeed's CPU accelerator only
    if dist.get_backend() == "gloo":
        from metaseq_ds.distributed import gloo_collectives
        from metaseq_ds.private_apis.deepspeed_comm import route_deepspeed_collectives

        route_deepspeed_collectives(gloo_collectives.all_gather_into_tensor_in_place,
                                    gloo_collectives.reduce_scatter_tensor_in_place)
    if tensor_parallel_size > 1:
        from metaseq_ds.private_apis.deepspeed_tensor_parallel import init_tensor_parallel_groups

        init_tensor_parallel_groups(tensor_parallel_size)


def start_process_group() -> None:
    """DeepSpeed's process group (the environment prepared), freed at a clean exit."""
    import deepspeed
    # Its functions take `group=group.WORLD` as a default, evaluated at import: imported after
    # the group starts (by torch.distributed.fsdp, inside deepspeed.initialize), they would hold
    # the default group past its destruction, until the interpreter finalises.
    import torch.distributed.nn.functional  # noqa: F401

    deepspeed.init_distributed()
    atexit.register(destroy_process_groups_at_a_clean_exit)


def destroy_process_groups_at_a_clean_exit() -> None:
    """At exit, free the process groups this process started, unless it is exiting on an uncaught
    exception. A group left to the interpreter's finalisation can abort a run that succeeded: a
    gloo worker thread finishing its last work then needs the GIL, and the process ends with
    "terminate called without an active exception" (exit -6; pytorch/pytorch#179291 describes
    it). Destroying a group stops its threads only once its last reference goes, so first every
    DeepSpeed engine still alive is destroyed (its hooks hold it through autograd's C++ side, out
    of the garbage collector's reach) and DeepSpeed's process-wide references dropped, then the
    groups destroyed and the cycles that held them collected. PyTorch asks callers to destroy their
    groups; after an uncaught exception (`sys.last_value` set) they are left alone, as torchtitan
    does, since a rank that failed mid-collective could block in the teardown."""
    if dist.is_initialized() and getattr(sys, "last_value", None) is None:
        destroy_deepspeed_engines()
        drop_deepspeeds_references()
        dist.destroy_process_group()
        gc.collect()


def destroy_deepspeed_engines() -> None:
    """`destroy()` every DeepSpeed engine still alive: it removes their hooks, which keep them
    alive through autograd's C++ side, so the garbage collector can free them."""
    from deepspeed import DeepSpeedEngine

    for engine in [obj for obj in gc.get_objects() if issubclass(type(obj), DeepSpeedEngine)]:
        engine.destroy()


def release_shm_buffer() -> None:
    """Unlink this rank's DeepSpeed all-reduce buffer from /dev/shm as soon as every rank has
    mapped it (`private_apis.deepspeed_comm.shm_allreduce_buffer`). The mappings keep the memory
    usable until the processes exit, and then the kernel frees it: nothing is left behind however the run ends
    (normal exit, usage error, Ctrl-C, kill), where each launch used to leave ~66 MB per rank."""
    from metaseq_ds.private_apis.deepspeed_comm import shm_allreduce_buffer

    try:
        barrier()  # every rank is past its initialisation, so it has mapped the others' buffers
    finally:
        shm_allreduce_buffer(get_global_rank()).unlink(missing_ok=True)


def get_global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _tp_groups():
    """DeepSpeed's group registry when tensor parallelism was set up, else None."""
    if not dist.is_initialized():
        return None
    from deepspeed.utils import groups

    from metaseq_ds.private_apis.deepspeed_tensor_parallel import tensor_parallel_groups_initialized

    return groups if tensor_parallel_groups_initialized() else None


def get_tensor_model_parallel_group():
    groups = _tp_groups()
    return groups.get_tensor_model_parallel_group() if groups else None


def get_tensor_model_parallel_world_size() -> int:
    groups = _tp_groups()
    return groups.get_tensor_model_parallel_world_size() if groups else 1


def get_tensor_model_parallel_rank() -> int:
    groups = _tp_groups()
    return groups.get_tensor_model_parallel_rank() if groups else 0


def get_data_parallel_group():
    """None means all ranks (no tensor parallelism: every rank is a data-parallel rank)."""
    groups = _tp_groups()
    return groups.get_data_parallel_group() if groups else None


def get_data_parallel_world_size() -> int:
    groups = _tp_groups()
    return groups.get_data_parallel_world_size() if groups else get_world_size()


def get_data_parallel_rank() -> int:
    groups = _tp_groups()
    return groups.get_data_parallel_rank() if groups else get_global_rank()


# metaseq's names for the same queries.
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank


def is_master() -> bool:
    return get_global_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: List[float], group=None) -> List[float]:
    """Sum a few scalars over `group` (default: all ranks), in float64 so token counts stay exact."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def collective_device() -> torch.device:
    """Where the process group's collectives take their tensors: NCCL's are on the rank's GPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
