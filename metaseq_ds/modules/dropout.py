"""`Dropout`: metaseq's FairseqDropout, a dropout that can stay on at inference.

Sampling with "MC dropout" needs dropout in eval mode; `apply_during_inference = True`
turns that on for one module without putting the whole model in training mode.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Dropout(nn.Module):
    """Dropout with probability `p`, active in training mode or when `apply_during_inference`."""

    def __init__(self, p: float, module_name: Optional[str] = None):
        super().__init__()
        self.p = p
        self.module_name = module_name
        self.apply_during_inference = False

    def forward(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        if self.p > 0 and (self.training or self.apply_during_inference):
            return F.dropout(x, p=self.p, training=True, inplace=inplace)
        return x

    def extra_repr(self) -> str:
        return f"p={self.p}"
