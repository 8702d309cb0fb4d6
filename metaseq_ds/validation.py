"""The one validation pass: `task.valid_step` over a split's batches, then the criterion's
metrics over the whole split (metaseq's valid line), in `mseq train` and `mseq validate` alike.

The logging outputs stay where the criterion made them until the split is done; then they are
combined over the data-parallel ranks (`logging.reduction`: one all-reduce, or one gather) and
reduced by `task.reduce_metrics` in an aggregator of their own, apart from training's meters.
So a split costs one read of the device, not one per batch, and its figures are the split's:
the loss is the split's summed loss over its summed sample size, `wpb` and `bsz` its tokens
and sentences.
"""

import logging
from typing import Any, Dict, Iterable, Optional

import torch

from metaseq_ds.device import module_device, to_device
from metaseq_ds.logging import metrics
from metaseq_ds.logging.reduction import combine_over_ranks, reduce_and_log
from metaseq_ds.models.transformer_decoder import note_left_padding

logger = logging.getLogger(__name__)

Sample = Dict[str, Any]


@torch.no_grad()
def validate(
    task,
    model,
    criterion,
    batches: Iterable[Sample],
    max_steps: Optional[int] = None,
    device: Optional[torch.device] = None,
    group=None,
) -> Dict[str, float]:
    """The metrics the criterion (and task) logged over at most `max_steps` batches of each rank,
    combined over the ranks of `group` (None: all ranks; one process: this one), on `device`
    (default: the model's). Empty if no rank had a batch."""
    device = module_device(model) if device is None else device
    logging_outputs = []
    for step, sample in enumerate(batches):
        if max_steps is not None and step >= max_steps:
            break
        _, _, logging_output = task.valid_step(to_device(note_left_padding(sample, model), device), model, criterion)
        logging_outputs.append(logging_output)
    combined = combine_over_ranks(logging_outputs, criterion.logging_outputs_can_be_summed(), group, may_be_empty=True)
    if not any(combined):
        logger.warning("validation: no batches (the split is empty or smaller than the ranks); nothing to report")
        return {}
    with metrics.aggregate(new_root=True):
        values = reduce_and_log(task, criterion, combined)
    # One reduction has no duration of its own to divide by: a words-per-second is not measured.
    return {key: value for key, value in values.items() if key != "wps"}
