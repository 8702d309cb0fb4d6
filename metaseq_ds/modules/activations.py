"""Activation functions by the names that fairseq's and metaseq's `--activation-fn` take.

One table for the decoder's FFN (`models.transformer_decoder`) and for plugins
(`metaseq_ds.utils.get_activation_fn`), so a plugin asking for "gelu" gets the decoder's gelu.
"""

import functools

import torch
import torch.nn.functional as F


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).pow(2)


def linear(x: torch.Tensor) -> torch.Tensor:
    return x


ACTIVATIONS = {
    "relu": F.relu,
    # NOTE: exact (erf) gelu, as fairseq's "gelu" and HF OPT's; metaseq's own "gelu" was the
    # tanh approximation, which is "gelu_accurate" here (fairseq's name for it).
    "gelu": F.gelu,
    "gelu_accurate": functools.partial(F.gelu, approximate="tanh"),
    "tanh": torch.tanh,
    "linear": linear,
    "relu_squared": relu_squared,
    "swish": F.silu,
}
