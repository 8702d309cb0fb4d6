"""Load DeepSpeed checkpoint files with `torch.load(weights_only=True)`.

DeepSpeed's own loader unpickles arbitrary objects (`weights_only=False`). Its files hold
tensors, plain containers and a few DeepSpeed enums/sizes, so the restricted unpickler can
read them once those few classes are allow-listed; anything else in a file is refused.
Our own client state adds one class: a task's state may hold `Dictionary` objects
(`tasks.stateful_container`), as metaseq's tasks kept theirs.
"""

import torch

from metaseq_ds.data.dictionary import Dictionary
from metaseq_ds.private_apis.deepspeed_checkpoints import checkpoint_file_classes, replace_checkpoint_loader


def safe_load(path, map_location=None, mmap: bool = False):
    """`torch.load(weights_only=True)` that also accepts DeepSpeed's own few classes and `Dictionary`."""
    with torch.serialization.safe_globals([*checkpoint_file_classes(), Dictionary]):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


def use_weights_only_loading(engine) -> None:
    replace_checkpoint_loader(engine, safe_load)
