"""Decoding a batch of jobs with the model: in one process, or on every rank of a launcher.

Under `deepspeed --num_gpus N --module metaseq_ds.cli.serve ...` each rank holds its shard of
the model (`GeneratorInterface.load_model` splits it by the tensor-parallel plan). Rank 0 serves
HTTP and runs the batcher; before it decodes a batch it broadcasts the batch (token ids and
options) to the other ranks, which wait in `follow()` and decode the same batch with it: the
logits are gathered, so every rank chooses the same tokens, and only rank 0's results are used.
What rank 0 broadcasts: a batch, an empty one (a heartbeat while idle), or None (stop).
"""

import logging
from typing import List, Optional, Tuple

from metaseq_ds.generation_options import GenerationOptions
from metaseq_ds.serving.batcher import Done, Job, Token

logger = logging.getLogger("metaseq_ds.serving")

Batch = Optional[Tuple[List[List[int]], List[GenerationOptions]]]


class ModelRunner:
    """`runner(jobs)` decodes one batch (the batcher's `run_batch`), delivering each job's results."""

    def __init__(self, interface, ranks: int):
        self.interface = interface
        self.ranks = ranks

    def __call__(self, jobs: List[Job]) -> None:
        prompts = [prompt for job in jobs for prompt in job.prompts]
        options = [job.options for job in jobs for _ in job.prompts]
        if self.ranks > 1:
            _broadcast((prompts, options) if jobs else ())
        if not jobs:
            return
        owners = [(job, index) for job in jobs for index in range(len(job.prompts))]

        def stream(prompt: int, token: int) -> None:  # every token: the server's metrics count them
            job, index = owners[prompt]
            job.deliver(Token(index, token))

        results = self.interface.generate(prompts, options=options, stream=stream)
        start = 0
        for job in jobs:
            job.deliver(Done(results[start:start + len(job.prompts)]))
            start += len(job.prompts)

    def follow(self) -> None:
        """On ranks other than 0: decode what rank 0 broadcasts until it says stop."""
        while True:
            batch = _broadcast(None)
            if batch is None:
                logger.info("rank %d: rank 0 stopped serving; stopping", _rank())
                return
            if batch:
                prompts, options = batch
                self.interface.generate(prompts, options=options)

    def stop(self) -> None:
        """On rank 0, when it stops serving: let the other ranks return from `follow`."""
        if self.ranks > 1:
            try:
                _broadcast(None)
            except RuntimeError as error:  # they are gone already (killed by the launcher)
                logger.warning("could not tell the other ranks to stop: %s", error)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _broadcast(batch: Batch) -> Batch:
    """Rank 0's `batch` on every rank (the others pass None)."""
    import torch.distributed as dist

    holder = [batch]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
