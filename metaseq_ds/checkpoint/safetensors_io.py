"""Safetensors (and torch) weight files one tensor at a time: read lazily, written streamed.

Reading: `read_weight_file` maps each name to a tensor read only by `.contiguous()`
(`SafetensorsTensor`; `.bin`/`.pt` files are memory-mapped), so a caller converting tensor by
tensor never holds two copies of a model.

Writing: `safetensors.torch.save_file` wants every tensor in memory at once; a model export must
not hold two copies of the model, so the header is computed from shapes first and each
tensor is produced, written and dropped in turn (`write_file`; `write_model` shards with an
index, as Hugging Face folders are). The format: 8-byte little-endian header length, a JSON
header (name -> dtype, shape, byte offsets), then the raw bytes.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

import torch

from metaseq_ds.errors import UsageError

DTYPE_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL",
}


@dataclass
class PendingTensor:
    """A tensor to write: its name, final shape and dtype, and how to produce it."""

    name: str
    shape: Sequence[int]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2KB' or a byte count -> bytes (decimal units, as Hugging Face's)."""
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    upper = text.strip().upper()
    size = None
    for unit, factor in units.items():
        if upper.endswith(unit) and upper[: -len(unit)].strip().replace(".", "", 1).isdigit():
            size = int(float(upper[: -len(unit)]) * factor)
            break
    else:
        if upper.isdigit():
            size = int(upper)
    if size is None:
        raise ValueError(f"not a size: {text!r} (examples: 5GB, 500MB)")
    if size < 1:
        raise ValueError(f"{text!r} is less than 1 byte: a shard must hold something (examples: 5GB, 500MB)")
    return size


def plan_shards(tensors: List[PendingTensor], max_shard_bytes: int) -> List[List[PendingTensor]]:
    """Consecutive groups of at most `max_shard_bytes` (a larger tensor gets a shard alone)."""
    shards: List[List[PendingTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return shards


def write_file(path: Path, tensors: List[PendingTensor], metadata: Dict[str, str]) -> None:
    header: Dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for tensor in tensors:
            value = tensor.produce()
            if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
                raise RuntimeError(f"{tensor.name}: produced {tuple(value.shape)} {value.dtype}, "
                                   f"planned {tuple(tensor.shape)} {tensor.dtype}")
            # A uint8 view shares memory, so writing copies nothing (bf16 has no numpy dtype).
            out.write(value.contiguous().view(-1).view(torch.uint8).numpy().data)
            del value


def write_model(folder: Path, tensors: List[PendingTensor], max_shard_bytes: int) -> List[Path]:
    """`model.safetensors`, or `model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`."""
    metadata = {"format": "pt"}
    shards = plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        write_file(folder / "model.safetensors", shards[0], metadata)
        return [folder / "model.safetensors"]
    weight_map, paths = {}, []
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_file(folder / name, shard, metadata)
        weight_map.update({tensor.name: name for tensor in shard})
        paths.append(folder / name)
    index_data = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2) + "\n")
    return paths


def read_weight_file(path: Path) -> Dict[str, Any]:
    """Every tensor of a `.safetensors`, `.bin` or `.pt` file, each read when it is used."""
    if not path.is_file():
        raise UsageError(f"{path}: listed in the index but missing")
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            handle = safe_open(str(path), framework="pt")
            return {key: SafetensorsTensor(path, handle, key) for key in handle.keys()}
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # safetensors and torch raise many types for a damaged file
        raise _unreadable(path, error) from None


def _unreadable(path: Path, error: Exception) -> UsageError:
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return UsageError(f"{path}: cannot read (truncated or damaged file?): {first}")


class SafetensorsTensor:
    """One tensor of a safetensors file, read only when `.contiguous()` is called."""

    def __init__(self, path: Path, handle, key: str):
        self.path, self.handle, self.key = path, handle, key
        self.shape = torch.Size(handle.get_slice(key).get_shape())

    def contiguous(self) -> torch.Tensor:
        try:
            return self.handle.get_tensor(self.key)
        except Exception as error:  # a file cut short fails only when its data is read
            raise _unreadable(self.path, error) from None
