"""The one validation loop: a criterion's summed loss over a split's batches, per unit of its
sample size, in bits (metaseq reports base 2), summed over the data-parallel ranks.

`mseq train` runs it on the DeepSpeed engine each rank holds, `mseq validate` on a plain
model in one process; only the device move and the reduction over ranks differ.
"""

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from metaseq_ds.logging.update_window import perplexity

Sample = Dict[str, Any]


@torch.no_grad()
def validation_loss(
    task,
    model,
    criterion,
    batches: Iterable[Sample],
    max_steps: Optional[int] = None,
    to_device: Callable[[Sample], Sample] = lambda sample: sample,
    sum_over_ranks: Callable[[List[float]], List[float]] = lambda values: values,
) -> Dict[str, float]:
    """{"loss": bits per sample-size unit (per token for the LM criteria), "ppl": 2 ** loss,
    "ntokens": target tokens seen}, over at most `max_steps` batches of each rank."""
    loss_sum = sample_size = tokens = 0.0
    for step, sample in enumerate(batches):
        if max_steps is not None and step >= max_steps:
            break
        _, size, logging_output = task.valid_step(to_device(sample), model, criterion)
        loss_sum += float(logging_output["loss"])
        sample_size += float(size)
        tokens += float(logging_output["ntokens"])
    loss_sum, sample_size, tokens = sum_over_ranks([loss_sum, sample_size, tokens])
    loss = loss_sum / max(sample_size, 1.0) / math.log(2)
    return {"loss": loss, "ppl": perplexity(loss), "ntokens": tokens}
