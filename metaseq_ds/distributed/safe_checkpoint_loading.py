"""Load DeepSpeed checkpoint files with `torch.load(weights_only=True)`.

DeepSpeed's own loader unpickles arbitrary objects (`weights_only=False`). Its files hold
tensors, plain containers and a few DeepSpeed enums/sizes, so the restricted unpickler can
read them once those few classes are allow-listed; anything else in a file is refused.
"""

from typing import Any

import torch


def _allowed_globals() -> list:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler, torch.Size]


def safe_load(path, map_location=None, mmap: bool = False):
    """`torch.load(weights_only=True)` that also accepts DeepSpeed's own few classes."""
    with torch.serialization.safe_globals(_allowed_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class WeightsOnlyCheckpointEngine:
    """Wraps an engine's checkpoint engine; only `load` changes."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location=map_location)


def use_weights_only_loading(engine) -> None:
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(engine.checkpoint_engine)
