"""Reusable layers (metaseq's `metaseq.modules`): dropout and position embeddings.

The transformer blocks themselves live with the decoder in
`metaseq_ds.models.transformer_decoder`, so that the model reads in one file.
"""

from metaseq_ds.modules.dropout import Dropout
from metaseq_ds.modules.positional_embedding import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEmbedding,
    make_positions,
)

__all__ = ["Dropout", "LearnedPositionalEmbedding", "SinusoidalPositionalEmbedding", "make_positions"]
