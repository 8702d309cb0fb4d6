"""Start the process group the same way alone, under `deepspeed` and under `torchrun`.

A plain `mseq train` has no launcher and no cluster environment: it becomes a world of
one on 127.0.0.1 with a free port. Launchers set RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*.
On a machine without CUDA, DeepSpeed's CPU accelerator is chosen and talks over gloo.
"""

import os
import socket
from typing import List

import torch
import torch.distributed as dist


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
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "OMP_NUM_THREADS" not in os.environ:
        # Ranks sharing a CPU must split its cores, or they slow each other down 2-7x.
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_ranks)))


def init_distributed(distributed_port: int = -1) -> None:
    prepare_environment(distributed_port)
    if dist.is_initialized():
        return
    import deepspeed

    deepspeed.init_distributed()


def get_global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# Without tensor parallelism every rank is a data-parallel rank.
get_data_parallel_rank = get_global_rank
get_data_parallel_world_size = get_world_size


def is_master() -> bool:
    return get_global_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: List[float]) -> List[float]:
    """Sum a few scalars over all ranks (float64, so token counts stay exact)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()
