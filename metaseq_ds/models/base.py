"""Base classes of models, encoders and decoders (metaseq's `BaseModel`, `BaseDecoder`, ...).

A model is built by its classmethod `build_model(cfg, task)` from its config dataclass and
the task (which owns the dictionary). Decoders return `(output, extra)`: logits of shape
(B, T, V) and a dict of side outputs such as `inner_states`. fairseq's
`FairseqIncrementalDecoder` is `IncrementalDecoder` here, the same class as `BaseDecoder`.

Incremental decoding (what `SequenceGenerator` relies on): `forward(prev_output_tokens,
incremental_state=state)` always receives every token so far, (B, S). On the first call the
state dict is empty and the decoder runs the whole prefix (the prompt); afterwards it runs only
the tokens its cache has not seen (normally the last one) and returns their outputs. Between
steps the generator calls `reorder_incremental_state(state, new_order)` to pick, duplicate or
drop batch rows of every cache (beam search, finished rows).
"""

from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from metaseq_ds.incremental_decoding_utils import with_incremental_state
from metaseq_ds.modules.linear import lay_out_for_decoding

NetOutput = Tuple[torch.Tensor, Optional[Dict[str, Any]]]


def normalized_probs(logits: torch.Tensor, log_probs: bool) -> torch.Tensor:
    """(log-)softmax over the last dim, in fp32 whatever the logits' dtype."""
    logits = logits.float()
    return F.log_softmax(logits, dim=-1) if log_probs else F.softmax(logits, dim=-1)


@with_incremental_state
class BaseDecoder(nn.Module):
    """A decoder over `dictionary`: `extract_features` then `output_layer`."""

    def __init__(self, dictionary):
        super().__init__()
        self.dictionary = dictionary

    def forward(self, prev_output_tokens: torch.Tensor, **kwargs) -> NetOutput:
        features, extra = self.extract_features(prev_output_tokens, **kwargs)
        return self.output_layer(features), extra

    def extract_features(self, prev_output_tokens: torch.Tensor, **kwargs) -> NetOutput:
        """(B, T, C) features before the output projection, and the side outputs."""
        raise NotImplementedError(f"{type(self).__name__} must implement extract_features")

    def output_layer(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
        """Project features to the vocabulary: (B, T, C) -> (B, T, V)."""
        raise NotImplementedError(f"{type(self).__name__} must implement output_layer")

    def get_normalized_probs(self, net_output: NetOutput, log_probs: bool, sample=None) -> torch.Tensor:
        return normalized_probs(net_output[0], log_probs)

    def reorder_incremental_state(self, incremental_state: Dict[str, Any], new_order: torch.Tensor) -> None:
        """Row i of every cache becomes old row `new_order[i]`: asks each submodule that caches
        (has its own `reorder_incremental_state`) to do so. Override for state kept elsewhere."""
        _reorder_children(self, incremental_state, new_order)

    def max_positions(self) -> int:
        """The longest input the decoder accepts."""
        return int(1e6)


IncrementalDecoder = BaseDecoder


def _reorder_children(module: nn.Module, incremental_state: Dict[str, Any], new_order: torch.Tensor) -> None:
    # A child that reorders its own state is not descended into: it handles its submodules,
    # and visiting them again would reorder their caches twice.
    for child in module.children():
        if hasattr(child, "reorder_incremental_state"):
            child.reorder_incremental_state(incremental_state, new_order)
        else:
            _reorder_children(child, incremental_state, new_order)


class BaseEncoder(nn.Module):
    """An encoder over `dictionary` (kept so that code naming FairseqEncoder imports)."""

    def __init__(self, dictionary):
        super().__init__()
        self.dictionary = dictionary

    def forward(self, src_tokens: torch.Tensor, src_lengths: Optional[torch.Tensor] = None, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def max_positions(self) -> int:
        return int(1e6)


class BaseModel(nn.Module):
    """The base of every registered model."""

    @classmethod
    def build_model(cls, cfg, task) -> "BaseModel":
        """Build the model from its config dataclass and the task."""
        raise NotImplementedError(f"{cls.__name__} must implement build_model")

    def get_targets(self, sample: Dict[str, Any], net_output: NetOutput) -> torch.Tensor:
        return sample["target"]

    def get_normalized_probs(self, net_output: NetOutput, log_probs: bool, sample=None) -> torch.Tensor:
        if hasattr(self, "decoder"):
            return self.decoder.get_normalized_probs(net_output, log_probs, sample)
        return normalized_probs(net_output[0], log_probs)

    def max_positions(self) -> Optional[int]:
        return None

    # The seed the parameters were drawn from (see `models.initialization`): a model built on the
    # meta device keeps it, so that its parameters are materialised with the same values.
    init_seed: Optional[int] = None

    def reset_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        """Fill `value`, the whole (unsharded) parameter `name` (as in `named_parameters()`), with its
        initial value, drawing only from `generator`. A model that defines this can be built on the
        meta device and materialised shard by shard, so no rank ever holds all of it; one that does
        not is built whole on every rank, then sharded (plugins that predate this)."""
        raise NotImplementedError(f"{type(self).__name__} does not define reset_parameter")

    @classmethod
    def can_materialize(cls) -> bool:
        """Whether the model defines `reset_parameter` (and so can be built on the meta device)."""
        return cls.reset_parameter is not BaseModel.reset_parameter

    generation_only = False  # set by make_generation_fast_

    def prepare_for_inference_(self, cfg=None) -> None:
        """fairseq's name for `make_generation_fast_` (the generation settings in `cfg` change nothing here)."""
        self.make_generation_fast_()

    def make_generation_fast_(self, **unused) -> None:
        """Make this model faster to generate with, and inference-only, as fairseq's did: eval
        mode, the Linear weights laid out for decoding steps (`lay_out_for_decoding`: same
        values, no extra memory), and `train()` refused from then on: the layout is for reading,
        and ZeRO's flat buffers set up earlier would no longer hold the moved weights."""
        self.eval()
        lay_out_for_decoding(self)
        self.generation_only = True

    def train(self, mode: bool = True) -> "BaseModel":
        if mode and self.generation_only:
            raise RuntimeError(f"{type(self).__name__} cannot train after make_generation_fast_ (load it again to train)")
        return super().train(mode)


class LanguageModel(BaseModel):
    """A decoder-only model: `forward(src_tokens)` is `decoder(src_tokens)`."""

    def __init__(self, decoder: BaseDecoder):
        super().__init__()
        if not isinstance(decoder, BaseDecoder):
            raise TypeError(f"{type(self).__name__} needs a BaseDecoder, got {type(decoder).__name__}")
        self.decoder = decoder

    def forward(self, src_tokens: torch.Tensor, **kwargs) -> NetOutput:
        return self.decoder(src_tokens, **kwargs)

    def extract_features(self, src_tokens: torch.Tensor, **kwargs) -> NetOutput:
        return self.decoder.extract_features(src_tokens, **kwargs)

    def output_layer(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.decoder.output_layer(features, **kwargs)

    def max_positions(self) -> int:
        return self.decoder.max_positions()

    @property
    def supported_targets(self):
        return {"future"}


class EncoderDecoderModel(BaseModel):
    """An encoder and a decoder that attends to the encoder's output."""

    def __init__(self, encoder: BaseEncoder, decoder: BaseDecoder):
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder

    def forward(self, src_tokens, src_lengths, prev_output_tokens, **kwargs) -> NetOutput:
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, **kwargs)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out, **kwargs)

    def max_positions(self):
        return (self.encoder.max_positions(), self.decoder.max_positions())
