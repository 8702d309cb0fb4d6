"""Position embeddings with metaseq's (and OPT's) padding convention.

Positions count non-pad tokens from `padding_idx + 1`; pad tokens get `padding_idx`. With
`padding_idx = 1` the first real token has position 2: the "offset 2" of Hugging Face OPT,
and the same positions for left- or right-padded rows, so a left-padded prompt is embedded
exactly like the unpadded one.
"""

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def make_positions(tokens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """(B, T) positions: cumulative count of non-pad tokens + padding_idx; pads get padding_idx."""
    mask = tokens.ne(padding_idx).long()
    return torch.cumsum(mask, dim=1) * mask + padding_idx


def table_rows(tokens: torch.Tensor, start: int, positions: Optional[torch.Tensor], padding_idx: int) -> torch.Tensor:
    """The table rows of tokens[:, start:]: from their count in the row, or from explicit
    `positions` counted from 0 (a static KV cache's indices), the first real token's row being
    padding_idx + 1 either way."""
    if positions is not None:
        return positions + (padding_idx + 1)
    return make_positions(tokens, padding_idx)[:, start:]


class LearnedPositionalEmbedding(nn.Embedding):
    """A learned table of `max_positions + padding_idx + 1` rows (OPT: max_positions + 2)."""

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int):
        rows = max_positions + padding_idx + 1
        # `_weight`: left to the model's initialiser (see TransformerDecoder.reset_parameter).
        super().__init__(rows, embedding_dim, padding_idx, _weight=torch.empty(rows, embedding_dim))
        self.max_positions = max_positions

    def forward(self, tokens: torch.Tensor, start: int = 0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T - start, C): the embeddings of tokens[:, start:] (positions count the whole row),
        or, given `positions` (B, T) counted from 0, of those positions."""
        return super().forward(table_rows(tokens, start, positions, self.padding_idx))


class SinusoidalPositionalEmbedding(nn.Module):
    """fairseq's fixed sinusoids (sin half, then cos half); the padding row is zero.

    The table is a non-persistent buffer, so it never appears in a state dict (fairseq
    checkpoints of such models have no position weights either).
    """

    def __init__(self, max_positions: int, embedding_dim: int, padding_idx: int):
        super().__init__()
        self.max_positions = max_positions
        self.padding_idx = padding_idx
        self.register_buffer(
            "weights", self.table(max_positions + padding_idx + 1, embedding_dim, padding_idx), persistent=False
        )

    @staticmethod
    def table(num_embeddings: int, embedding_dim: int, padding_idx: int) -> torch.Tensor:
        # Computed on the CPU even while a model is built on the meta device: a buffer has no
        # initialiser to materialise it later, and the table is the same on every rank.
        half_dim = embedding_dim // 2
        exponents = torch.arange(half_dim, dtype=torch.float, device="cpu")
        frequencies = torch.exp(exponents * -(math.log(10000) / (half_dim - 1)))
        angles = torch.arange(num_embeddings, dtype=torch.float, device="cpu")[:, None] * frequencies[None, :]
        table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
        if embedding_dim % 2 == 1:
            table = torch.cat([table, torch.zeros(num_embeddings, 1, device="cpu")], dim=1)
        table[padding_idx, :] = 0
        return table

    def forward(self, tokens: torch.Tensor, start: int = 0, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, T - start, C): the embeddings of tokens[:, start:] (positions count the whole row),
        or, given `positions` (B, T) counted from 0, of those positions."""
        return F.embedding(table_rows(tokens, start, positions, self.padding_idx), self.weights)
