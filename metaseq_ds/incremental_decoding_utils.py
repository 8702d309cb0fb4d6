"""Per-module state for incremental decoding (the KV cache), with fairseq's and metaseq's names.

Generation calls a decoder once per new token with one `incremental_state` dict that lives as
long as the generation. Each module that caches something (an attention layer's keys and
values) keeps it there under a key private to that module instance, so the dict can be
shared by every layer of the model:

    @with_incremental_state
    class MyAttention(nn.Module):
        def forward(self, x, incremental_state=None):
            saved = self.get_incremental_state(incremental_state, "attn_state")  # None on the first call
            ...
            self.set_incremental_state(incremental_state, "attn_state", {"prev_key": k, "prev_value": v})

        def reorder_incremental_state(self, incremental_state, new_order):
            ...  # index_select(0, new_order) on every cached tensor (beam search, finished rows)

A caller that knows how long its sequences will grow (a generator: prompt + new tokens) says so
once with `reserve_positions(state, n)`, so that caches allocate their buffers once for n
positions instead of growing (see `metaseq_ds.modules.kv_cache`).

fairseq's `FairseqIncrementalState` is `IncrementalState`.
"""

import uuid
from typing import Any, Dict, Optional

IncrementalStateDict = Dict[str, Dict[str, Any]]

# Shared by every module of the state (not private to one instance like the others).
RESERVED_POSITIONS = "reserved_positions"


def reserve_positions(incremental_state: IncrementalStateDict, positions: int) -> None:
    """Say that the sequences of this state will reach at most `positions` tokens."""
    incremental_state[RESERVED_POSITIONS] = {"positions": positions}


def reserved_positions(incremental_state: IncrementalStateDict) -> int:
    """The positions reserved for this state, 0 if the caller did not say."""
    return incremental_state.get(RESERVED_POSITIONS, {"positions": 0})["positions"]


class IncrementalState:
    """Mixin: `get_incremental_state` / `set_incremental_state` under a key unique to this instance."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_incremental_state()

    def init_incremental_state(self) -> None:
        self._incremental_state_id = str(uuid.uuid4())

    def _get_full_incremental_state_key(self, key: str) -> str:
        return f"{self._incremental_state_id}.{key}"

    def get_incremental_state(self, incremental_state: Optional[IncrementalStateDict], key: str) -> Optional[Dict[str, Any]]:
        """This module's saved value under `key`, or None (no state given, or nothing saved yet)."""
        full_key = self._get_full_incremental_state_key(key)
        if incremental_state is None or full_key not in incremental_state:
            return None
        return incremental_state[full_key]

    def set_incremental_state(
        self, incremental_state: Optional[IncrementalStateDict], key: str, value: Dict[str, Any]
    ) -> Optional[IncrementalStateDict]:
        """Save `value` under `key` (a no-op without a state: a full forward caches nothing)."""
        if incremental_state is not None:
            incremental_state[self._get_full_incremental_state_key(key)] = value
        return incremental_state


def with_incremental_state(cls):
    """Class decorator: make `cls` an `IncrementalState` (put the mixin first among its bases)."""
    cls.__bases__ = (IncrementalState,) + tuple(base for base in cls.__bases__ if base is not IncrementalState)
    return cls
