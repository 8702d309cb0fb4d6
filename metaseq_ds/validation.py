"""The one validation loop: a criterion's summed loss over a split's batches, per unit of its
sample size, in bits (metaseq reports base 2), summed over the data-parallel ranks.

`mseq train` runs it on the DeepSpeed engine each rank holds, `mseq validate` on a plain
model in one process; only the reduction over ranks differs. Each batch is moved to the
model's device, and the sums stay there until the split is done: one read of the device per
split, not one per batch.
"""

import math
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

from metaseq_ds.device import module_device, to_device
from metaseq_ds.logging.update_window import perplexity

Sample = Dict[str, Any]


@torch.no_grad()
def validation_loss(
    task,
    model,
    criterion,
    batches: Iterable[Sample],
    max_steps: Optional[int] = None,
    device: Optional[torch.device] = None,
    sum_over_ranks: Callable[[List[float]], List[float]] = lambda values: values,
) -> Dict[str, float]:
    """{"loss": bits per sample-size unit (per token for the LM criteria), "ppl": 2 ** loss,
    "ntokens": target tokens seen}, over at most `max_steps` batches of each rank, on `device`
    (default: the model's)."""
    device = module_device(model) if device is None else device
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, sample size, tokens
    for step, sample in enumerate(batches):
        if max_steps is not None and step >= max_steps:
            break
        _, size, logging_output = task.valid_step(to_device(sample, device), model, criterion)
        for index, value in enumerate((logging_output["loss"], size, logging_output["ntokens"])):
            sums[index] += value
    loss_sum, sample_size, tokens = sum_over_ranks(sums.tolist())
    loss = loss_sum / max(sample_size, 1.0) / math.log(2)
    return {"loss": loss, "ppl": perplexity(loss), "ntokens": tokens}
