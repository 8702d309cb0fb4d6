"""Reusable layers (metaseq's `metaseq.modules`): dropout, position embeddings, a Linear with
a faster fp32 CPU kernel; `modules.cross_entropy` has a cross entropy for large vocabularies.

The transformer blocks themselves live with the decoder in
`metaseq_ds.models.transformer_decoder`, so that the model reads in one file.
"""

from metaseq_ds.modules.dropout import Dropout
from metaseq_ds.modules.linear import Linear
from metaseq_ds.modules.positional_embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    make_positions,
)

__all__ = [
    "Dropout",
    "LearnedPositionalEmbedding",
    "Linear",
    "SinusoidalPositionalEmbedding",
    "make_positions",
]
