"""`KVCache`: one attention layer's keys and values during incremental decoding, in buffers
allocated once and written in place.

A step writes only its new keys and values after the cached ones. Appending with `torch.cat`
instead would copy the whole cache at every step (quadratic in the length over a generation,
and a fresh allocation per layer per step). The buffers are sized for the positions the caller
reserved (`incremental_decoding_utils.reserve_positions`, as `SequenceGenerator` does) and
grow, doubling, only for a caller that reserved fewer.
"""

import torch


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
