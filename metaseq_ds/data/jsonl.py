"""metaseq's streaming data layout: finding a split's shards and reading jsonl documents lazily.

    <data>/train/00/*.jsonl, <data>/train/01/*.jsonl, ...   shards 00..K-1; epoch e reads shard (e-1) % K
    <data>/valid/00/*.jsonl                                 split "valid"
    <data>/valid/<name>/00/*.jsonl                          split "valid/<name>" (metaseq's --valid-subset)

A split is named by its path under the data directory, as in metaseq. Each line of a jsonl
file is one JSON object whose "text" field is a document. Files are indexed (byte offset of
every line) on first use and read line by line on demand, so corpora may exceed memory.
"""

from array import array
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

from metaseq_ds.data.base_dataset import BaseDataset
from metaseq_ds.data.jsonl_record import MalformedLine, document_text
from metaseq_ds.errors import UsageError


class JsonlDataset(BaseDataset):
    """The documents of one .jsonl file: item i is the "text" of its i-th non-blank line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offsets = None  # byte offset of each non-blank line, built on first use
        self._line_numbers = None  # its 1-based line number, for error messages

    def _index(self) -> None:
        offsets, line_numbers = array("q"), array("q")  # 8 bytes a line, even for huge files
        position = 0
        with open(self.path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    offsets.append(position)
                    line_numbers.append(number)
                position += len(line)
        self._offsets = np.frombuffer(offsets, dtype=np.int64)
        self._line_numbers = np.frombuffer(line_numbers, dtype=np.int64)

    def __len__(self) -> int:
        if self._offsets is None:
            self._index()
        return len(self._offsets)

    def __getitem__(self, index: int) -> str:
        if self._offsets is None:
            self._index()
        with open(self.path, "rb") as f:
            f.seek(int(self._offsets[index]))
            line = f.readline()
        try:
            return document_text(line)
        except MalformedLine as error:
            raise UsageError(f"{self.path}:{self._line_numbers[index]}: {error}") from None


class JsonlSplit:
    """One split of a data directory: its shard directories and each epoch's documents."""

    def __init__(self, data: Path, split: str):
        self.data = Path(data)
        self.split = split
        self.shards = shard_dirs(self.data, split)
        # Only the current shard's index is kept: a corpus may have many large shards.
        self._documents: Optional[Tuple[Path, torch.utils.data.ConcatDataset]] = None

    def shard_for_epoch(self, epoch: int) -> Path:
        return self.shards[(epoch - 1) % len(self.shards)]

    def documents(self, epoch: int) -> torch.utils.data.ConcatDataset:
        """The texts of the shard that `epoch` reads: its jsonl files in name order, concatenated."""
        shard = self.shard_for_epoch(epoch)
        if self._documents is None or self._documents[0] != shard:
            files = [JsonlDataset(path) for path in shard_files(shard)]
            documents = torch.utils.data.ConcatDataset(files)
            if len(documents) == 0:
                raise UsageError(f"{shard} holds no documents: its *.jsonl files have no non-blank lines")
            self._documents = (shard, documents)
        return self._documents[1]


def shard_files(shard: Path) -> List[Path]:
    """The jsonl files of a shard directory in the order their documents are concatenated."""
    return sorted(shard.glob("*.jsonl"))


def check_data_dir(data: Path) -> Path:
    data = Path(data)
    if not data.is_dir():
        raise UsageError(f"DATA: directory {data} does not exist (expected {data}/train/00/*.jsonl)")
    return data


def shard_dirs(data: Path, split: str) -> List[Path]:
    """The shard directories 00..K-1 of `split`, in order; UsageError when the layout is wrong."""
    root = check_data_dir(data) / split
    if not root.is_dir():
        found = ", ".join(list_splits(data)) or "none"
        raise UsageError(f"{root} does not exist: no split {split!r} in {data} (splits found: {found})")
    numbered = sorted((int(p.name), p) for p in root.iterdir() if p.is_dir() and p.name.isdigit())
    numbered = [(number, p) for number, p in numbered if any(p.glob("*.jsonl"))]
    if not numbered:
        named = [s for s in list_splits(data) if s.startswith(split + "/")]
        hint = f"; named subsets here: {', '.join(named)}" if named else ""
        raise UsageError(f"{root} has no shard directories 00, 01, ... with *.jsonl files{hint}")
    numbers = [number for number, _ in numbered]
    if numbers != list(range(len(numbers))):
        raise UsageError(f"{root}: shard directories must be numbered 00..{len(numbers) - 1:02d} without gaps, found {numbers}")
    return [p for _, p in numbered]


def list_splits(data: Path) -> List[str]:
    """Every split of `data`: "train", "valid" and "valid/<name>" wherever shards 00/*.jsonl exist."""
    data = Path(data)
    if not data.is_dir():
        return []
    return sorted(
        shard.parent.relative_to(data).as_posix()
        for shard in data.rglob("00")
        if shard.is_dir() and any(shard.glob("*.jsonl"))
    )
