"""The KV cache: attention keys and values kept across decoding steps, in buffers allocated
once and written in place.

`StaticKVCache` (what `mseq generate` and the decoding step use): every layer, fixed slots and
capacity, positions written by index and read through a mask, so a step is one fixed graph.
`KVCache`: one layer's cache behind the `incremental_state` API (beam search, and decoders of
plugins that follow fairseq's incremental decoding), grown by length.

Either way a step writes only its new keys and values. Appending with `torch.cat` instead would
copy the whole cache at every step (quadratic in the length over a generation, and a fresh
allocation per layer per step). `KVCache`'s buffers are sized for the positions the caller
reserved (`incremental_decoding_utils.reserve_positions`, as `SequenceGenerator` does) and
grow, doubling, only for a caller that reserved fewer.
"""

from typing import NamedTuple, Optional, Tuple

import torch
from torch import nn


class KVCache:
    """Keys and values, (B, nh, capacity, hs) each, of which the first `length` positions are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        B, nh, T, hs = keys.shape
        self.keys = keys.new_empty(B, nh, max(capacity, T), hs)
        self.values = values.new_empty(B, nh, max(capacity, T), hs)
        self.length = 0
        self.append(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        """Write the new (B, nh, T, hs) keys and values after the cached ones; returns (B, nh, S, hs)
        views of all S = length + T of them."""
        end = self.length + keys.size(2)
        if end > self.keys.size(2):
            self._grow(max(end, 2 * self.keys.size(2)))
        self.keys[:, :, self.length:end] = keys
        self.values[:, :, self.length:end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def select_rows(self, order: torch.Tensor) -> None:
        """Row i becomes old row `order[i]` (beam search follows its beams, finished rows leave);
        in place unless `order` has more rows than the buffers (beams expanding a prompt)."""
        kept_keys = self.keys[:, :, :self.length].index_select(0, order)  # (len(order), nh, length, hs)
        kept_values = self.values[:, :, :self.length].index_select(0, order)
        rows = order.numel()
        if rows > self.keys.size(0):
            self.keys = self.keys.new_empty(rows, *self.keys.shape[1:])
            self.values = self.values.new_empty(rows, *self.values.shape[1:])
        else:
            self.keys, self.values = self.keys[:rows], self.values[:rows]
        self.keys[:, :, :self.length] = kept_keys
        self.values[:, :, :self.length] = kept_values

    def _grow(self, capacity: int) -> None:
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(old.size(0), old.size(1), capacity, old.size(3))
            new[:, :, :self.length] = old[:, :, :self.length]
            setattr(self, name, new)


class StaticKVCache(nn.Module):
    """Every attention layer's keys and values for `slots` sequences of at most `capacity`
    positions each, allocated once: the token at position p of slot s is kept at index p of
    slot s, written in place there, and read back through a mask of the positions filled so far.

    Nothing about it changes shape from one decoding step to the next, so the step can be one
    fixed graph (compiled, and replayed as a CUDA graph). Slots are independent: a generator
    fills slots 0 .. B-1 with its B rows; a continuous-batching scheduler prefills a new request
    into a free slot (`slots=`) while the others decode, and reuses a slot when its sequence
    ends (positions from 0 again, masked past what was written); beam search reorders the slots
    in place (`reorder`). A module, so that its buffers are what compiled code treats as fixed
    addresses (torch.compile's CUDA graphs assume that of a module's buffers, not of other
    tensors it mutates).
    """

    def __init__(self, slots: int, capacity: int):
        super().__init__()
        self.slots, self.capacity = slots, capacity

    def buffers_of(self, layer: int):
        """(keys, values) of `layer`, (slots, nh, capacity, hs) each; None before its first write."""
        return getattr(self, f"keys_{layer}", None), getattr(self, f"values_{layer}", None)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               slots: Optional[torch.Tensor] = None, length: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Write (B, nh, T, hs) keys and values at `positions` (B, T) of `slots` (B,) (None: slots
        0 .. B-1); returns all (B, nh, capacity, hs) keys and values of those slots, or their
        first `length` positions.

        A layer's buffers are allocated at its first write (a prefill, never a compiled step) with
        the heads and dtype it writes: a tensor-parallel rank's share of the heads, for one.
        Zeros, not empty memory: a masked-out key has weight 0, and 0 x NaN would still be NaN.
        """
        cached_keys, cached_values = self.buffers_of(layer)
        if cached_keys is None:
            B, nh, T, hs = keys.shape
            shape = (self.slots, nh, self.capacity, hs)
            self.register_buffer(f"keys_{layer}", keys.new_zeros(shape), persistent=False)
            self.register_buffer(f"values_{layer}", values.new_zeros(shape), persistent=False)
            cached_keys, cached_values = self.buffers_of(layer)
        rows = slots if slots is not None else torch.arange(keys.size(0), device=keys.device)
        # Indexing dims 0 and 2 puts the indexed dims first: (B, T, nh, hs) is what is written.
        cached_keys[rows[:, None], :, positions] = keys.transpose(1, 2)
        cached_values[rows[:, None], :, positions] = values.transpose(1, 2)
        if slots is None:  # the first B slots: a view, no copy
            return cached_keys[:keys.size(0), :, :length], cached_values[:keys.size(0), :, :length]
        return cached_keys[rows, :, :length], cached_values[rows, :, :length]

    def attention_mask(self, positions: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """(B, 1, T, capacity or `length`), True = may attend: the query at position p sees cached
        positions 0 .. p."""
        cached = torch.arange(length or self.capacity, device=positions.device)
        return (cached[None, None, :] <= positions[:, :, None])[:, None]

    def window(self, length: int) -> "CacheWindow":
        """This cache read up to position `length` only (every written position below it)."""
        return CacheWindow(self, length)

    @torch.no_grad()
    def reorder(self, order: torch.Tensor) -> None:
        """Slot i becomes old slot `order[i]`, in place (`order`: `slots` indices; beam search
        follows its beams)."""
        for buffer in self.buffers():
            buffer.copy_(buffer.index_select(0, order))

    @torch.no_grad()
    def clear(self) -> None:
        """Forget every slot's keys and values (zeros again), keeping the buffers."""
        for buffer in self.buffers():
            buffer.zero_()


class CacheWindow(NamedTuple):
    """The first `length` positions of a `StaticKVCache`, used where the cache is (an eager step
    whose sequences are all shorter reads only those; a compiled step keeps the whole cache, its
    one shape). Writes go to the cache itself."""

    cache: StaticKVCache
    length: int

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
               slots: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cache.update(layer, keys, values, positions, slots, self.length)

    def attention_mask(self, positions: torch.Tensor) -> torch.Tensor:
        return self.cache.attention_mask(positions, self.length)


class CacheWrite(NamedTuple):
    """Where one attention layer's new keys and values go in a `StaticKVCache` (see `update`)."""

    cache: StaticKVCache  # or a CacheWindow of one
    layer: int
    positions: torch.Tensor  # (B, T)
    slots: Optional[torch.Tensor]  # (B,), or None: slots 0 .. B-1
