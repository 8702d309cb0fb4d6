"""`DistributedModel` (fairseq's `DistributedFairseqModel`): wrap a model for data-parallel use.

`mseq train` never calls this: DeepSpeed's engine is the data-parallel wrapper there. It is
for plugin and script code that wrapped a model itself the fairseq way,

    model = DistributedModel(args, model, process_group=None, device=None)

and gets torch's `DistributedDataParallel` when a process group of more than one rank is
running, and the model unchanged otherwise (one process needs no wrapper). fairseq's other
`--ddp-backend` wrappers (legacy_ddp, slowmo, fully_sharded) are ZeRO stages of DeepSpeed here.
"""

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn


def DistributedModel(args: Any, model: nn.Module, process_group=None, device: Optional[torch.device] = None) -> nn.Module:
    """`model` under `DistributedDataParallel` across `process_group` (default: all ranks), or itself
    when there is no group of several ranks. `args` is accepted for fairseq's signature and unused."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return model
    device_ids = [device] if device is not None and torch.device(device).type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=process_group)
