"""A CPU stand-in for a GPU, to catch device mix-ups without one.

    with MetaDeviceCheck() as check:
        ...                    # a step with the model's weights on the meta device
    check.host_reads           # the device -> host reads it made (each a sync on a GPU)

The model is put on the `meta` device, the way a GPU run puts it on `cuda`; the data pipeline
still makes its batches on the CPU. On a GPU, an operation that meets a CPU tensor (other than a
0-dim scalar) and a device tensor stops with "Expected all tensors to be on the same device";
on the meta device many such operations pass silently (an embedding looks up CPU indices, a
matmul even answers on the CPU), so this mode checks every operation and raises
`DeviceMixup` instead. Moves (`.to`, `copy_`) are allowed both ways, as on a GPU: a move to
the CPU, or a Python number read from the device (`.item()`, `float()`, `.tolist()`), returns
zeros and is recorded in `host_reads`, so loops that need a value go on.
"""

from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
DEVICE = torch.device("meta")
MOVES = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default, aten._copy_from_and_resize.default}


class DeviceMixup(AssertionError):
    """An operation mixed CPU tensors into the model's device: on a GPU it would fail."""


class MetaDeviceCheck(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.host_reads: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        on_device = any(tensor.device == DEVICE for tensor in tensors)
        if func is aten._local_scalar_dense.default and on_device:
            self.host_reads.append("item")
            return False if args[0].dtype == torch.bool else 0
        if func is aten._to_copy.default and args[0].device == DEVICE and kwargs.get("device") == torch.device("cpu"):
            self.host_reads.append("to cpu")
            return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
        if on_device and func not in MOVES:
            on_cpu = [tensor for tensor in tensors if tensor.device.type == "cpu" and tensor.dim() > 0]
            if on_cpu:
                raise DeviceMixup(f"{func}: a CPU tensor of shape {tuple(on_cpu[0].shape)} meets tensors on the "
                                  f"model's device; on a GPU: 'Expected all tensors to be on the same device'")
        return func(*args, **kwargs)
