"""`BaseDataset` (fairseq's `FairseqDataset`): the map-style dataset base plugin code extends.

Only the hooks fairseq-style datasets implement and callers use are kept: item access, length,
`collater` (a list of items -> a batch), `size` with `filter_indices_by_size` (what
`BaseTask.filter_indices_by_size` drops), `ordered_indices` and the `set_epoch` notification.
"""

from typing import Any, List, Optional, Tuple

import numpy as np
import torch


class BaseDataset(torch.utils.data.Dataset):
    """A dataset of numbered items; subclasses define `__getitem__`, `__len__` and, if they batch, `collater`."""

    def __getitem__(self, index: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define __getitem__")

    def __len__(self) -> int:
        raise NotImplementedError(f"{type(self).__name__} must define __len__")

    def collater(self, samples: List[Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not batch its items")

    def size(self, index: int) -> int:
        """An item's length in tokens, compared with the model's max positions."""
        raise NotImplementedError(f"{type(self).__name__} must define size to be filtered by size")

    def filter_indices_by_size(self, indices: np.ndarray, max_sizes: Optional[int]) -> Tuple[np.ndarray, List[int]]:
        """`indices` without the items longer than `max_sizes` (None: no limit), and those left out."""
        indices = np.asarray(indices, dtype=np.int64)
        if max_sizes is None:
            return indices, []
        fits = np.array([self.size(int(i)) <= max_sizes for i in indices], dtype=bool)
        return indices[fits], indices[~fits].tolist()

    def ordered_indices(self) -> np.ndarray:
        """The order in which to visit items (fairseq sorted by size here; plain order by default)."""
        return np.arange(len(self), dtype=np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of each epoch, for datasets whose content depends on it."""
