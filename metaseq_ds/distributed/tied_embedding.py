"""Under ZeRO-3, a tied embedding's gradient is made after the backward, straight into its partitions.

    tied = defer_tied_embedding_gradient(engine)  # after deepspeed.initialize; None when it does not apply
    engine.backward(loss)
    tied.add_to_gradient_partition(first_micro_step)  # after every backward, before engine.step()

With `share_decoder_input_output_embed` one weight W (vocabulary shard x width) is used twice:
the input embedding (first in the forward) and the output projection (first in the backward).
Autograd sums the two gradients before it calls W's accumulator, that is when the backward
reaches the embedding, last. Under ZeRO-3 each rank then held, through its whole backward, the
output projection's gradient of W, and at its end W gathered again (ZeRO-3 gathers a module's
parameters before its backward, although an embedding's backward never reads them) and the
embedding's dense gradient: three whole copies of W (412 MB each for OPT's 50272 x 2048 in fp32).

Here autograd never makes a gradient of W. The embedding looks its tokens up without autograd
reaching W (so ZeRO-3 has no backward to gather it for) and its output becomes a leaf whose
gradient (tokens x width) is kept; the output projection runs with W not requiring a gradient
and the gradient of its logits (tokens x vocabulary shard) is kept, with its input. After the
engine's backward, W's gradient is made from those in chunks of its flat partitions: each
chunk holds every rank's slice of the same offsets, is reduce-scattered over the data-parallel
group (divided by its size, as ZeRO-3 averages; through DeepSpeed's backend, on gloo in place)
and written into this rank's partition through DeepSpeed's public `safe_get_local_grad` /
`safe_set_local_grad` (overwritten at the first micro-step of an update, added to after). A
rank never holds more of W's gradient than a chunk (`CHUNK_ELEMENTS` for all ranks' slices
together), at any size: at opt_175b on 1024 ranks with TP=8 a rank's partition of W is 0.6M
elements, at 707M on 2 ranks 52M.
"""

from typing import List, Optional, Tuple

import torch
from torch import nn

from metaseq_ds.distributed import utils as dist_utils

# Elements of one chunk of the gradient, all ranks' slices together (64 MB in fp32).
CHUNK_ELEMENTS = 2**24


def defer_tied_embedding_gradient(engine) -> Optional["TiedEmbeddingGradient"]:
    """Set up the deferred gradient for `engine`'s model when it trains under ZeRO-3 with its token
    embedding tied to its output projection; None otherwise (nothing changed)."""
    if engine.zero_optimization_stage() != 3:
        return None
    decoder = getattr(engine.module, "decoder", None)
    embedding = getattr(decoder, "embed_tokens", None)
    head = getattr(decoder, "output_projection", None)
    if embedding is None or head is None or getattr(embedding, "weight", None) is not getattr(head, "weight", None):
        return None
    if getattr(head, "bias", None) is not None:
        return None
    if isinstance(embedding, nn.Embedding):
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            return None  # their gradients are not plain sums of rows
        return TiedEmbeddingGradient(embedding, head, vocab_start=0, padding_idx=embedding.padding_idx)
    if hasattr(embedding, "vocab_start_index"):  # DeepSpeed's VocabParallelEmbedding: a vocabulary shard
        local_padding = embedding.padding_idx
        padding_idx = None if local_padding is None else local_padding + embedding.vocab_start_index
        return TiedEmbeddingGradient(embedding, head, vocab_start=embedding.vocab_start_index, padding_idx=padding_idx,
                                     scale=getattr(embedding, "embed_scale", None))
    return None


class TiedEmbeddingGradient:
    """W's gradient, made after the backward from what it kept of W's two uses."""

    def __init__(self, embedding: nn.Module, head: nn.Module, vocab_start: int, padding_idx: Optional[int],
                 scale: Optional[torch.Tensor] = None):
        self.weight = embedding.weight
        self.vocab_start, self.padding_idx, self.scale = vocab_start, padding_idx, scale
        self.rows, self.width = self.weight.ds_shape  # the shard's (the parameter itself is partitioned)
        self.group = dist_utils.get_data_parallel_group()
        self.group_size = dist_utils.get_data_parallel_world_size()
        self.group_rank = dist_utils.get_data_parallel_rank()
        self._embedded: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (tokens, gradient of their embeddings)
        self._projected: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (projection input, gradient of its logits)
        # ZeRO-3's hooks were registered by the engine, so they run before these: the lookup's
        # output needs no backward when ZeRO-3 sees it, and W is gathered when it is frozen.
        embedding.forward = torch.no_grad()(embedding.forward)
        embedding.register_forward_hook(self._embedding_as_leaf)
        head.register_forward_pre_hook(self._freeze_weight)
        head.register_forward_hook(self._keep_projection)

    @staticmethod
    def _training(module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _embedding_as_leaf(self, module: nn.Module, inputs, output: torch.Tensor) -> Optional[torch.Tensor]:
        if not self._training(module):
            return None
        tokens = inputs[0]
        leaf = output.detach().requires_grad_()
        leaf.register_hook(lambda grad: self._embedded.append((tokens, grad)))
        return leaf

    def _freeze_weight(self, module: nn.Module, inputs) -> None:
        if self._training(module):
            self.weight.requires_grad_(False)  # the projection's backward then makes no gradient of W

    def _keep_projection(self, module: nn.Module, inputs, output: torch.Tensor) -> None:
        if not self._training(module):
            return
        self.weight.requires_grad_(True)
        features = inputs[0]
        output.register_hook(lambda grad: self._projected.append((features, grad)))

    @torch.no_grad()
    def add_to_gradient_partition(self, first_micro_step: bool) -> None:
        """Make this micro-batch's gradient of W, summed over the data-parallel group and divided
        by its size, in this rank's partition: written at an update's first micro-step, added to
        after. Every rank of the group must call it, also one that kept nothing."""
        from deepspeed import comm as deepspeed_comm
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        from metaseq_ds.private_apis import zero3_partition_start

        partition = safe_get_local_grad(self.weight)  # flat: this rank's slice of the padded W
        # In the training dtype, as autograd would have multiplied them (bf16 products run on oneDNN)
        projected = [(features.reshape(-1, self.width), self._local_logits(grad)) for features, grad in self._projected]
        rows, row_grads = self._embedded_rows(partition.device)
        self._projected, self._embedded = [], []
        size = partition.numel()
        step = max(1, min(size, CHUNK_ELEMENTS // self.group_size))
        for offset in range(0, size, step):
            length = min(step, size - offset)
            slices = torch.zeros(self.group_size, length, device=partition.device)
            for rank in range(self.group_size):
                start = zero3_partition_start(self.weight, rank) + offset
                self._fill(slices[rank], start, min(start + length, self.rows * self.width), projected, rows, row_grads)
            mine = slices[self.group_rank]
            if self.group_size > 1:  # through DeepSpeed's backend: in place on gloo (gloo_collectives)
                deepspeed_comm.reduce_scatter_fn(mine, slices.view(-1), group=self.group)
                mine /= self.group_size
            target = partition.narrow(0, offset, length)
            if first_micro_step:
                target.copy_(mine)
            else:
                target.add_(mine)
        safe_set_local_grad(self.weight, partition)

    def _local_logits(self, grad: torch.Tensor) -> torch.Tensor:
        """(tokens, shard rows): the gradient of this shard's logits (gathered logits hold them all)."""
        grad = grad.reshape(-1, grad.size(-1))
        return grad if grad.size(1) == self.rows else grad[:, self.vocab_start:self.vocab_start + self.rows]

    def _embedded_rows(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(n,) rows of this shard the embedding looked up and their (n, width) fp32 gradients."""
        if not self._embedded:
            return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, self.width, device=device)
        tokens = torch.cat([t.reshape(-1) for t, _ in self._embedded])
        grads = torch.cat([g.reshape(-1, self.width) for _, g in self._embedded]).float()
        if self.scale is not None:
            grads = grads * self.scale.float()
        keep = (tokens >= self.vocab_start) & (tokens < self.vocab_start + self.rows)
        if self.padding_idx is not None:
            keep &= tokens != self.padding_idx  # the padding row gets no gradient (nn.Embedding's rule)
        return (tokens[keep] - self.vocab_start).to(device), grads[keep].to(device)

    def _fill(self, out: torch.Tensor, start: int, end: int, projected, rows: torch.Tensor, row_grads: torch.Tensor) -> None:
        """out[:end - start] = W's gradient at flat positions [start, end) (nothing when empty:
        the padding past W's end stays zero)."""
        if start >= end:
            return
        first, last = start // self.width, (end - 1) // self.width + 1  # the rows those positions fall in
        block = torch.zeros(last - first, self.width, device=out.device)
        for features, logits_grad in projected:
            if features.dtype == block.dtype:
                block.addmm_(logits_grad[:, first:last].t(), features)
            else:  # summed in fp32, each product in the training dtype
                block += torch.mm(logits_grad[:, first:last].t(), features)
        inside = (rows >= first) & (rows < last)
        block.index_add_(0, rows[inside] - first, row_grads[inside])
        out[: end - start] = block.view(-1)[start - first * self.width:end - first * self.width]
