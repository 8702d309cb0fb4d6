"""`BaseDataset` (fairseq's `FairseqDataset`): the map-style dataset base plugin code extends.

Only the hooks fairseq-style datasets implement and callers use are kept: item access, length,
`collater` (a list of items -> a batch), `ordered_indices` and the `set_epoch` notification.
"""

from typing import Any, List

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

    def ordered_indices(self) -> np.ndarray:
        """The order in which to visit items (fairseq sorted by size here; plain order by default)."""
        return np.arange(len(self), dtype=np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Called at the start of each epoch, for datasets whose content depends on it."""
