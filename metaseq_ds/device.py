"""Where a step's tensors live: one rule for training, validation, generation and serving.

    device = module_device(model)           # the device of the model's weights
    sample = to_device(sample, device)      # a batch (nested dicts/lists of tensors) moved once

Every tensor a step makes takes its device from the model or its input; a batch is made on the
CPU by the data pipeline and moved here once, `non_blocking` (a real overlap when the batch
sits in pinned memory: `pin` does that in the data pipeline's background thread on CUDA).
`tests/test_device_mixups.py` runs the steps with the model on the meta device and fails on
any operation that mixes CPU tensors into it.
"""

from typing import Any, Callable

import torch


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of `module`'s first parameter (or buffer); the CPU for a module of neither.

    A ZeRO-3-partitioned parameter's data is an empty placeholder on the rank's own device, so
    the answer holds for partitioned models too."""
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


def to_device(sample: Any, device: torch.device) -> Any:
    """`sample` with every tensor in it on `device` (searched as `map_tensors` does)."""
    return map_tensors(sample, lambda tensor: tensor.to(device, non_blocking=True))


def pin(sample: Any) -> Any:
    """`sample` with its CPU tensors in page-locked memory, so that `to_device` overlaps the copy
    to a CUDA device with compute. Without CUDA there is nothing to pin for: `sample` as it is."""
    if not torch.cuda.is_available():
        return sample
    return map_tensors(sample, lambda tensor: tensor.pin_memory() if tensor.device.type == "cpu" else tensor)


def map_tensors(sample: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`sample` with `fn` applied to every tensor in it (dicts, lists, tuples and sets searched);
    anything else is kept as it is."""
    if torch.is_tensor(sample):
        return fn(sample)
    if isinstance(sample, dict):
        return {key: map_tensors(value, fn) for key, value in sample.items()}
    if isinstance(sample, tuple) and hasattr(sample, "_fields"):  # a namedtuple takes its fields one by one
        return type(sample)(*(map_tensors(value, fn) for value in sample))
    if isinstance(sample, (list, tuple, set)):
        return type(sample)(map_tensors(value, fn) for value in sample)
    return sample
