"""Parameter initialisation that does not depend on how the model is laid out.

Each parameter is drawn from its own generator, seeded by (the model's seed, the parameter's
name). A parameter's initial value is therefore the same whether the model is built whole on
one process, or on the meta device and materialised shard by shard on 1024 ranks under any
tensor-parallel degree (`metaseq_ds.distributed.materialize`): a rank draws the whole
parameter from its generator and keeps its slice, never depending on which other parameters
it draws. Which distribution each parameter gets is the model's `reset_parameter`.

The model's seed is one draw from torch's global generator when the model is built, so
`torch.manual_seed(s)` before building decides the weights, as it always has.
"""

import hashlib
from typing import Optional, Sequence

import torch
from torch import nn


def initialization_seed() -> int:
    """One draw from torch's global (CPU) generator, even when building on the meta device."""
    return int(torch.randint(0, 2**62, (1,), device="cpu").item())


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator parameter `name` is drawn from (the same on every rank and layout)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def initialize_parameters(model: nn.Module, seed: int) -> None:
    """Give every (real, whole) parameter of `model` its initial value (`model.reset_parameter`);
    parameters on the meta device are left for `materialize`. A tied parameter is drawn once."""
    for name, param in model.named_parameters():  # yields a tied parameter once, under its first name
        if not param.is_meta:
            model.reset_parameter(name, param.data, parameter_generator(seed, name))
    model.init_seed = seed


class InitialValues:
    """The model's initial values, parameter by parameter, for `distributed.materialize`:
    `model.reset_parameter` over the whole parameter, from its own generator, then this rank's part."""

    def __init__(self, model: nn.Module, seed: int):
        self.model, self.seed = model, seed

    def whole(self, name: str, full_shape: Sequence[int]) -> torch.Tensor:
        value = torch.empty(tuple(full_shape), device="cpu")
        self.model.reset_parameter(name, value, parameter_generator(self.seed, name))
        return value

    def shard(self, name: str, full_shape: Sequence[int], dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        return rank_part(self.whole(name, full_shape), dim, rank, size)

    def check_all_used(self, parameter_names) -> None:
        """Every parameter draws its own value: nothing can be left over."""


def rank_part(whole: torch.Tensor, dim: Optional[int], rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s part of `whole` cut into `size` equal parts along `dim` (None: all of it), in
    storage of its own. A view would keep the whole tensor alive as long as the parameter lives,
    and a part along dim 0 is contiguous already, so `.contiguous()` would return that view (at
    707M with TP=2 under ZeRO-1/2 the embedding's part, alone in its optimizer group, kept the whole
    412 MB vocabulary weight: +0.19 GiB a rank)."""
    if dim is None or size == 1:
        return whole
    return whole.chunk(size, dim=dim)[rank].clone(memory_format=torch.contiguous_format)
