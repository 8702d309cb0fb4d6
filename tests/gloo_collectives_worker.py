"""Run on 3 ranks (`deepspeed --num_gpus 3 tests/gloo_collectives_worker.py`): the in-place gloo
collectives (`distributed.gloo_collectives`) against torch's own, on the world and on a group
of ranks 1 and 2 (group ranks are not global ranks), fp32 and bf16, blocking and not, and with
DeepSpeed's calls routed to them by `utils.init_distributed`. Rank 0 prints `GLOO {...}`."""

import json

import deepspeed.comm
import torch
import torch.distributed as dist

from metaseq_ds.distributed import gloo_collectives
from metaseq_ds.distributed import utils as dist_utils


def inputs(rank: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(length, dtype=torch.float32) * (rank + 1) + 0.25 * rank).to(dtype)


def call(collective, output: torch.Tensor, input: torch.Tensor, group, async_op: bool) -> None:
    """Run one of ours to completion, through its handle when `async_op`."""
    handle = collective(output, input, group=group, async_op=async_op)
    if async_op:
        handle.wait()


def check_group(group, dtype: torch.dtype, async_op: bool) -> dict:
    """Whether ours equal torch's on this group, for an output slice passed as the input (as
    ZeRO-3 does) and for a separate input."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    length = 5
    expected_gather = torch.empty(length * size, dtype=dtype)
    dist.all_gather_into_tensor(expected_gather, inputs(rank, length, dtype), group=group)
    separate = torch.full((length * size,), -1.0, dtype=dtype)
    call(gloo_collectives.all_gather_into_tensor_in_place, separate, inputs(rank, length, dtype), group, async_op)
    aliased = torch.full((length * size,), -1.0, dtype=dtype)
    aliased.narrow(0, rank * length, length).copy_(inputs(rank, length, dtype))
    pointer = aliased.data_ptr()
    call(gloo_collectives.all_gather_into_tensor_in_place, aliased, aliased.narrow(0, rank * length, length), group,
         async_op)

    expected_reduced = torch.empty(length, dtype=dtype)
    dist.reduce_scatter_tensor(expected_reduced, inputs(rank, length * size, dtype), group=group)
    reduced = torch.empty(length, dtype=dtype)
    call(gloo_collectives.reduce_scatter_tensor_in_place, reduced, inputs(rank, length * size, dtype), group, async_op)
    scratch = inputs(rank, length * size, dtype)
    own_slice = scratch.narrow(0, rank * length, length)
    call(gloo_collectives.reduce_scatter_tensor_in_place, own_slice, scratch, group, async_op)
    return {"gather": torch.equal(separate, expected_gather), "gather_aliased": torch.equal(aliased, expected_gather),
            "gather_in_place": aliased.data_ptr() == pointer, "reduce": torch.equal(reduced, expected_reduced),
            "reduce_aliased": torch.equal(own_slice, expected_reduced)}


def check_routing() -> dict:
    """DeepSpeed's own entry points now reach ours (counted), with torch's results."""
    calls = {"gather": 0, "reduce": 0}
    ours_gather, ours_reduce = gloo_collectives.all_gather_into_tensor_in_place, gloo_collectives.reduce_scatter_tensor_in_place
    backend = deepspeed.comm.comm.cdb
    routed = backend.all_gather_function is ours_gather and backend.reduce_scatter_function is ours_reduce

    def counted_gather(*args, **kwargs):
        calls["gather"] += 1
        return ours_gather(*args, **kwargs)

    def counted_reduce(*args, **kwargs):
        calls["reduce"] += 1
        return ours_reduce(*args, **kwargs)

    backend.all_gather_function, backend.reduce_scatter_function = counted_gather, counted_reduce
    rank, size = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(4 * size)
    deepspeed.comm.allgather_fn(gathered, inputs(rank, 4, torch.float32), async_op=True).wait()
    reduced = torch.empty(4)
    deepspeed.comm.reduce_scatter_fn(reduced, inputs(rank, 4 * size, torch.float32))
    expected = torch.empty(4)
    dist.reduce_scatter_tensor(expected, inputs(rank, 4 * size, torch.float32))
    backend.all_gather_function, backend.reduce_scatter_function = ours_gather, ours_reduce
    return {"routed": routed, "calls": calls,
            "gathered": torch.equal(gathered, torch.cat([inputs(r, 4, torch.float32) for r in range(size)])),
            "reduced": torch.equal(reduced, expected)}


def main() -> None:
    dist_utils.init_distributed()
    pair = dist.new_group([1, 2])
    report = {"routing": check_routing()}
    for dtype in (torch.float32, torch.bfloat16):
        for async_op in (False, True):
            report[f"world {dtype} async={async_op}"] = check_group(None, dtype, async_op)
            if dist.get_rank() in (1, 2):
                pair_result = check_group(pair, dtype, async_op)
            else:
                pair_result = None
            results = [None] * dist.get_world_size()
            dist.all_gather_object(results, pair_result)
            report[f"ranks 1-2 {dtype} async={async_op}"] = results[1:]
    if dist.get_rank() == 0:
        print("GLOO " + json.dumps(report), flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
