"""ZeRO's two big collectives for gloo (CPU ranks), without gloo's second copy of their data.

gloo's `all_gather_into_tensor` gathers into a new flat tensor of the output's size and then
copies it into the output; its `reduce_scatter_tensor` allocates a tensor of the input's size.
So every ZeRO-3 parameter gather briefly held its result twice, and every gradient
reduce-scatter its input twice. The largest set the peaks: on the 707M model gathering the tied
embedding's 390 MB weight took 781 MB, and a layer's 33 MB FFN gradients (larger than a reduce
bucket, so reduced on their own) took three copies.

- `all_gather_into_tensor_in_place`: each rank broadcasts its slice straight into that slice of
  every rank's output. The same bytes arrive and nothing else is allocated.
- `reduce_scatter_tensor_in_place`: an in-place all-reduce of the input, whose slice of this
  rank is then the output. A ring all-reduce sends twice the bytes of a reduce-scatter, yet it
  allocates nothing and is faster here than gloo's reduce-scatter. The input is left holding the
  sum: ZeRO-3 (`reduce_scatter_coalesced`, its only caller on our paths) reduces a scratch buffer
  whose slice is the output.

Measured on this machine, 100M fp32 elements: all-gather 0.14 s against 0.61 s on 2 ranks, 0.42 s
against 1.2 s on 4; reduce-scatter 0.4 s against 0.8 s on 2 ranks, 1.2 s against 1.6 s on 4. NCCL
does both in place already; these are installed for gloo only (`utils.init_distributed`,
through `private_apis.deepspeed_comm.route_deepspeed_collectives`). One broadcast per rank suits
the few CPU ranks gloo serves; at GPU scale (a data-parallel group of 128 at opt_175b on 1024 ranks) NCCL's
own collectives run.
"""

from typing import List, Optional

import torch
import torch.distributed as dist

from metaseq_ds.private_apis.verified import relies_on


class _Works:
    """The handle of one collective made of several: waits for all of them."""

    def __init__(self, works: List[dist.Work]):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


@relies_on("torch", "gloo's all_gather_into_tensor (a second copy of the data)", written_for="2.13", cuda=False, private=False,
           test="tests/test_gloo_collectives.py::test_in_place_gloo_collectives_equal_torchs_and_deepspeed_reaches_them",
           why="gloo gathers into a new flat tensor, then copies it into the output "
               "(https://github.com/pytorch/pytorch/issues/29033): every ZeRO-3 parameter gather held its result "
               "twice (781 MB for the 707M model's 390 MB embedding); gloo only: NCCL works in place")
def all_gather_into_tensor_in_place(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                                    group: Optional[dist.ProcessGroup] = None,
                                    async_op: bool = False) -> Optional[_Works]:
    """`torch.distributed.all_gather_into_tensor`'s contract (output = every rank's input, in rank
    order; a waitable handle when `async_op`), one broadcast per rank into the output."""
    size = dist.get_world_size(group)
    if not output_tensor.is_contiguous() or output_tensor.numel() != input_tensor.numel() * size:
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
    slices = output_tensor.view(-1).split(input_tensor.numel())
    mine = slices[dist.get_rank(group)]
    if mine.data_ptr() != input_tensor.data_ptr():  # ZeRO-3's coalesced gathers pass that slice itself
        mine.copy_(input_tensor.reshape(-1))
    works = [dist.broadcast(part, group_src=source, group=group, async_op=True) for source, part in enumerate(slices)]
    return _finish(_Works(works), async_op)


@relies_on("torch", "gloo's reduce_scatter_tensor (a second copy of the data)", written_for="2.13", cuda=False, private=False,
           test="tests/test_gloo_collectives.py::test_in_place_gloo_collectives_equal_torchs_and_deepspeed_reaches_them",
           why="gloo's reduce-scatter clones its input, then all-reduces "
               "(https://github.com/pytorch/pytorch/pull/118911): every ZeRO-3 gradient reduce-scatter held its input"
               " twice (three copies of a 33 MB FFN gradient at 707M); gloo only: NCCL works in place")
def reduce_scatter_tensor_in_place(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                                   op=dist.ReduceOp.SUM, group: Optional[dist.ProcessGroup] = None,
                                   async_op: bool = False):
    """`torch.distributed.reduce_scatter_tensor`'s contract (output = this rank's slice of the
    inputs reduced over the group), except that the input is left holding the whole reduction."""
    size = dist.get_world_size(group)
    if not input_tensor.is_contiguous() or input_tensor.numel() != output_tensor.numel() * size:
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
    work = dist.all_reduce(input_tensor, op=op, group=group, async_op=True)
    mine = input_tensor.view(-1).split(output_tensor.numel())[dist.get_rank(group)]
    if mine.data_ptr() == output_tensor.data_ptr():  # ZeRO-3 reduces into that slice itself
        return _finish(work, async_op)
    work.wait()
    output_tensor.view(-1).copy_(mine)
    return _finish(_Works([]), async_op)


def _finish(handle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None
