"""The OPT-style transformer decoder, top to bottom: attention -> layer (attention + FFN) -> decoder.

Numerics follow Hugging Face `OPTForCausalLM` (the reference the parity tests compare to),
and module names follow its checkpoints (`self_attn.{q,k,v,out}_proj`, `fc1`, `fc2`,
`self_attn_layer_norm`, `final_layer_norm`, `embed_positions`, `project_in/out`), so the key
map to HF is a prefix. Everything is a plain single-device module: tensor parallelism and
activation checkpointing are applied from outside by swapping or wrapping the linear layers
(`modules.Linear`: an `nn.Linear` whose fp32 CPU products run on oneDNN) and layer submodules.

Generation: with an `incremental_state` dict each attention layer keeps its keys and values
(the KV cache, `modules.kv_cache.KVCache`: buffers allocated once, written in place), so a
step runs only the new token and costs O(length) instead of a re-run of the whole sequence
(see `metaseq_ds.models.base` for the calling convention).
"""

import inspect
import math
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from metaseq_ds.incremental_decoding_utils import reserved_positions, with_incremental_state
from metaseq_ds.models.base import BaseDecoder
from metaseq_ds.modules import Dropout, LearnedPositionalEmbedding, Linear, SinusoidalPositionalEmbedding
from metaseq_ds.modules.activations import ACTIVATIONS
from metaseq_ds.modules.cross_entropy import VocabularyProjection, cross_entropy
from metaseq_ds.modules.kv_cache import CacheWrite, KVCache, StaticKVCache


def embed_scale(cfg) -> float:
    """Token embeddings are multiplied by sqrt(decoder_embed_dim) unless --no-scale-embedding (OPT)."""
    return 1.0 if cfg.no_scale_embedding else math.sqrt(cfg.decoder_embed_dim)


def has_left_padding(is_pad: torch.Tensor) -> bool:
    """Whether a pad comes before a real token in some row of the (B, T) pad flags."""
    return bool((is_pad[:, :-1] & ~is_pad[:, 1:]).any())


def decoder_of(model: nn.Module) -> Optional["TransformerDecoder"]:
    """The `TransformerDecoder` that `model` (or a DeepSpeed engine's module) decodes with, or
    None for any other model."""
    decoder = getattr(getattr(model, "module", model), "decoder", None)
    return decoder if isinstance(decoder, TransformerDecoder) else None


def note_left_padding(sample: Dict[str, Any], model: nn.Module) -> Dict[str, Any]:
    """`sample` with `net_input["left_padded"]` said from its tokens while they are still on the
    CPU, where `model` (or a DeepSpeed engine's module) decodes with a `TransformerDecoder`:
    its attention mask is then chosen without a read of the device, a host sync per forward on
    a GPU. Any other model gets `sample` as it is (its forward may take no such argument)."""
    decoder = decoder_of(model)
    net_input = sample.get("net_input") if isinstance(sample, dict) else None
    tokens = net_input.get("src_tokens") if isinstance(net_input, dict) else None
    if decoder is None or tokens is None or tokens.device.type != "cpu":
        return sample
    left_padded = has_left_padding(tokens.eq(decoder.padding_idx))
    return {**sample, "net_input": {**net_input, "left_padded": left_padded}}


@with_incremental_state
class SelfAttention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v projections, and a KV cache."""

    def __init__(self, embed_dim: int, num_heads: int, attention_dropout: float):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"decoder_embed_dim {embed_dim} is not divisible by decoder_attention_heads {num_heads}")
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.q_proj = Linear(embed_dim, embed_dim)
        self.k_proj = Linear(embed_dim, embed_dim)
        self.v_proj = Linear(embed_dim, embed_dim)
        self.out_proj = Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], incremental_state=None,
                cache_write: Optional[CacheWrite] = None) -> torch.Tensor:
        """`attn_mask` None means plain causal attention: the decoder passes an explicit mask
        whenever that is not what the queries need (pads; several new tokens after a cache; a
        static cache's filled positions). `cache_write`: where in a `StaticKVCache` the new keys
        and values go (attention then reads every cached one of the slots)."""
        B, T, C = x.shape
        head_dim = C // self.num_heads
        # The head count is read from the projections' width (-1), not num_heads: a tensor-parallel
        # plan may swap in projections that produce only this rank's share of the heads.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, -1, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        if cache_write is not None:
            k, v = cache_write.cache.update(cache_write.layer, k, v, cache_write.positions, cache_write.slots)
        elif incremental_state is not None:
            saved = self.get_incremental_state(incremental_state, "attn_state")
            if saved is None:  # the prompt: the cache starts with its keys and values
                self.set_incremental_state(incremental_state, "attn_state",
                                           {"kv": KVCache(k, v, capacity=reserved_positions(incremental_state))})
            else:
                k, v = saved["kv"].append(k, v)  # (B, nh, S, hs), S = cached + T, written in place
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            # One query after a cache sees every key: no mask at all.
            is_causal=attn_mask is None and T > 1,
        )
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C) heads side by side again
        return self.out_proj(y)

    def reorder_incremental_state(self, incremental_state, new_order: torch.Tensor) -> None:
        saved = self.get_incremental_state(incremental_state, "attn_state")
        if saved is not None:
            saved["kv"].select_rows(new_order)


class TransformerDecoderLayer(nn.Module):
    """Attention block then feed-forward block, each with a residual; LayerNorm before them
    (pre-LN, most OPT sizes) or after the residual sum (post-LN, OPT-350m)."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.decoder_embed_dim
        self.normalize_before = cfg.decoder_normalize_before
        self.self_attn = SelfAttention(d, cfg.decoder_attention_heads, cfg.attention_dropout)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = Linear(d, cfg.decoder_ffn_embed_dim)
        self.fc2 = Linear(cfg.decoder_ffn_embed_dim, d)
        self.activation = ACTIVATIONS[cfg.activation_fn]
        self.activation_dropout = Dropout(cfg.activation_dropout, module_name="activation_dropout")
        self.final_layer_norm = nn.LayerNorm(d)
        self.dropout = Dropout(cfg.dropout, module_name="dropout")

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor], incremental_state=None,
                cache_write: Optional[CacheWrite] = None) -> torch.Tensor:
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x = residual + self.dropout(self.self_attn(x, attn_mask, incremental_state, cache_write))
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.fc2(self.activation_dropout(self.activation(self.fc1(x))))  # (B, T, ffn) inside
        x = residual + self.dropout(x)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


class TransformerDecoder(BaseDecoder):
    """Embeddings -> `decoder_layers` layers -> final LayerNorm -> projection to the vocabulary.

    `decoder_input_dim` != `decoder_embed_dim` (OPT-350m's word_embed_proj_dim) embeds tokens
    in the smaller width and maps in and out with `project_in` / `project_out`. With
    `share_decoder_input_output_embed` the output projection is the token embedding matrix.
    """

    def __init__(self, cfg, dictionary):
        super().__init__(dictionary)
        if cfg.max_target_positions is None:
            raise ValueError("max_target_positions is unset: give --max-target-positions or --tokens-per-sample")
        d = cfg.decoder_embed_dim
        input_dim = cfg.decoder_input_dim if cfg.decoder_input_dim is not None else d
        self.padding_idx = dictionary.pad()
        self.max_target_positions = cfg.max_target_positions
        self.embed_scale = embed_scale(cfg)
        self.init_std = cfg.init_std

        # `_weight`: no default initialisation, which `reset_parameter` replaces anyway (and
        # which, on the meta device, would load torch's compiler stack just to draw nothing).
        self.embed_tokens = nn.Embedding(len(dictionary), input_dim, self.padding_idx,
                                         _weight=torch.empty(len(dictionary), input_dim))
        self.project_in = Linear(input_dim, d, bias=False) if input_dim != d else None
        if cfg.no_token_positional_embeddings:
            self.embed_positions = None
        elif cfg.decoder_learned_pos:
            self.embed_positions = LearnedPositionalEmbedding(cfg.max_target_positions, d, self.padding_idx)
        else:
            self.embed_positions = SinusoidalPositionalEmbedding(cfg.max_target_positions, d, self.padding_idx)
        self.dropout = Dropout(cfg.dropout, module_name="dropout")
        self.layers = nn.ModuleList(TransformerDecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        # Post-LN layers already end in a LayerNorm; pre-LN ones need one after the last layer.
        has_final_norm = cfg.decoder_normalize_before and not cfg.no_decoder_final_norm
        self.final_layer_norm = nn.LayerNorm(d) if has_final_norm else None
        self.project_out = Linear(d, input_dim, bias=False) if input_dim != d else None
        self.output_projection = VocabularyProjection(input_dim, len(dictionary))
        if cfg.share_decoder_input_output_embed:
            self.output_projection.weight = self.embed_tokens.weight

    @torch.no_grad()
    def reset_parameter(self, name: str, value: torch.Tensor, generator: torch.Generator) -> None:
        """Initialise parameter `name` (relative to the decoder) as OPT did (Megatron-LM's scheme,
        OPT paper section 2.2), into `value`, the whole parameter:

        - token embeddings, learned position embeddings and every Linear weight (q/k/v_proj,
          fc1, project_in/out, an untied output_projection): normal(0, init_std), where
          init_std defaults to OPT's 0.006;
        - out_proj and fc2, which write into the residual stream: normal(0, init_std / sqrt(2L))
          for L layers, so the residual's variance does not grow with depth;
        - the padding rows of both embeddings: zero (metaseq's Embedding);
        - biases zero; LayerNorm weight one.
        Decided by name, so a tensor-parallel module (DeepSpeed's layers) initialises alike.
        """
        owner, _, kind = name.rpartition(".")
        if kind == "bias":
            value.zero_()
        elif owner.endswith("layer_norm"):
            value.fill_(1.0)
        else:
            residual = owner.endswith(("out_proj", "fc2"))
            std = self.init_std / math.sqrt(2 * len(self.layers)) if residual else self.init_std
            value.normal_(0.0, std, generator=generator)
            if owner in ("embed_tokens", "embed_positions"):
                value[self.padding_idx].zero_()

    def forward(
        self,
        prev_output_tokens: torch.Tensor,
        incremental_state: Optional[Dict[str, Any]] = None,
        features_only: bool = False,
        target: Optional[torch.Tensor] = None,
        left_padded: Optional[bool] = None,
        **unused,
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """(B, T) tokens -> ((B, T, V) logits, or (B, T, C) features if `features_only`; side outputs).

        With (B, T) `target`: (the summed cross entropy over the non-pad targets, fp32; side
        outputs with "token_losses", the (B * T,) losses, detached), the logits never made whole
        where the projection can (see `output_loss`).
        `left_padded`: whether a pad comes before a real token in some row, known where the
        batch was made (`note_left_padding`); None: `attention_mask` reads it from the tokens.
        `unused` takes the other entries of a batch's `net_input` (such as `src_lengths`).
        """
        features, extra = self.extract_features(prev_output_tokens, incremental_state=incremental_state,
                                                left_padded=left_padded)
        if target is not None:
            loss, extra["token_losses"] = self.output_loss(features, target)
            return loss, extra
        return (features if features_only else self.output_layer(features)), extra

    def extract_features(
        self, prev_output_tokens: torch.Tensor, incremental_state: Optional[Dict[str, Any]] = None, *,
        kv_cache: Optional[StaticKVCache] = None, positions: Optional[torch.Tensor] = None,
        slots: Optional[torch.Tensor] = None, left_padded: Optional[bool] = None, **unused
    ) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """(B, S) tokens -> (B, T, C) features of the tokens not yet cached (T = S without a cache).

        With a `kv_cache` (`StaticKVCache`) the tokens are only the new ones, (B, T), at
        `positions` (B, T, counted from 0) of the cache's `slots` (None: slots 0 .. B-1); their
        keys and values are written there and each attends to its slot's positions up to its own.
        """
        tokens = prev_output_tokens
        if kv_cache is not None:
            embedded = self.embed(tokens, self.position_embeddings(tokens, positions=positions))
            writes = [CacheWrite(kv_cache, index, positions, slots) for index in range(len(self.layers))]
            return self._layers(embedded, kv_cache.attention_mask(positions), None, writes)
        if tokens.size(1) > self.max_target_positions:
            raise ValueError(f"{tokens.size(1)} tokens exceed max_target_positions {self.max_target_positions}")
        cached = self.cached_length(incremental_state)
        # Positions count the real tokens of the whole row, so they need all of it.
        embedded = self.embed(tokens[:, cached:], self.position_embeddings(tokens, start=cached))
        features = self._layers(embedded, self.attention_mask(tokens, cached, left_padded), incremental_state,
                                [None] * len(self.layers))
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "cached_length", {"length": tokens.size(1)})
        return features

    def position_embeddings(self, tokens: torch.Tensor, start: int = 0,
                            positions: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Of tokens[:, start:], or of explicit `positions`; None for a model without them."""
        if self.embed_positions is None:
            return None
        return self.embed_positions(tokens, start=start, positions=positions)

    def embed(self, tokens: torch.Tensor, position_embeddings: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, T) tokens -> (B, T, C) scaled token embeddings (+ the position embeddings given), after dropout."""
        x = self.embed_tokens(tokens)  # (B, T, input_dim)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.project_in is not None:
            x = self.project_in(x)  # (B, T, C)
        if position_embeddings is not None:
            x = x + position_embeddings
        return self.dropout(x)

    def _layers(self, x: torch.Tensor, attn_mask, incremental_state, cache_writes) -> Tuple[torch.Tensor, Dict[str, Any]]:
        """(B, T, C) embeddings through every layer and the final norm (and project_out)."""
        inner_states = [x]
        for layer, cache_write in zip(self.layers, cache_writes):
            x = layer(x, attn_mask, incremental_state, cache_write)
            inner_states.append(x)

        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)  # (B, T, input_dim)
        return x, {"inner_states": inner_states}

    def cached_length(self, incremental_state: Optional[Dict[str, Any]]) -> int:
        """How many leading tokens the KV cache already holds (0 without a state, or on the first call)."""
        saved = self.get_incremental_state(incremental_state, "cached_length")
        return 0 if saved is None else saved["length"]

    def attention_mask(self, tokens: torch.Tensor, cached: int = 0,
                       left_padded: Optional[bool] = None) -> Optional[torch.Tensor]:
        """None when the causal mask suffices, else (B, 1, T, S) with True = may attend, for the
        T = S - `cached` new queries over all S keys.

        The causal mask alone is exact unless a pad comes before a real token (left padding):
        with pads only at the end of rows, as in training batches, no real token can see one.
        Keeping those batches on SDPA's causal path also keeps them on the same kernel as
        unpadded ones, so the loss does not depend on which batch happened to be padded.
        `left_padded` None: read from the tokens, which waits for the device (as metaseq's
        padding check did); the trainer and validation say it (`note_left_padding`).
        """
        is_pad = tokens.eq(self.padding_idx)
        S = tokens.size(1)
        T = S - cached
        several_after_cache = cached > 0 and T > 1
        if not several_after_cache and not (has_left_padding(is_pad) if left_padded is None else left_padded):
            return None
        # Query i is token cached + i: it sees keys 0 .. cached + i.
        causal = torch.ones(T, S, dtype=torch.bool, device=tokens.device).tril(diagonal=cached)  # (T, S)
        # A pad query attends to itself: a row with nothing to attend to makes softmax NaN,
        # and NaN in a pad position would spread (0 * NaN) into real ones.
        itself = torch.eye(T, S, dtype=torch.bool, device=tokens.device).roll(cached, dims=1)  # (T, S)
        return causal & (~is_pad[:, None, None, :] | itself)  # (B, 1, T, S)

    def output_layer(self, features: torch.Tensor, **kwargs) -> torch.Tensor:
        """(B, T, C) -> (B, T, V) logits."""
        return self.output_projection(features)

    def output_loss(self, features: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(B, T, C) features, (B, T) targets -> (summed loss over non-pad targets, fp32,
        differentiable; (B * T,) per-token losses, detached).

        Fused where the projection computes the loss itself (`fuses_output_loss`): no (B, T, V)
        logits, nor under tensor parallelism the (B, T, V/p) shard of them, nor under ZeRO-3's
        streamed tied embedding where activations are recomputed. Otherwise (that embedding
        without recomputation, under tensor parallelism, or in chunks of partial rows:
        `distributed.tied_embedding`) the projection makes the logits and the loss is
        `cross_entropy` of them: whole logits, which a tensor-parallel head gathers for the
        `cross_entropy` criterion
        (`vocab_parallel_cross_entropy` then reads the shards itself, not through here)."""
        if self.fuses_output_loss():
            return self.output_projection(features, target=target, ignore_index=self.padding_idx)
        logits = self.output_layer(features)
        losses = cross_entropy(logits.view(-1, logits.size(-1)), target.reshape(-1), ignore_index=self.padding_idx)
        return losses.sum(), losses.detach()

    def fuses_output_loss(self) -> bool:
        """Whether the output projection, given `target=`, returns the loss fused with its product
        (no logits): `VocabularyProjection`, and the tensor-parallel vocabulary head
        (`distributed.tensor_parallel`), unless their forward was replaced by one that only
        makes logits (which takes no target)."""
        return "target" in inspect.signature(self.output_projection.forward).parameters

    def max_positions(self) -> int:
        return self.max_target_positions
