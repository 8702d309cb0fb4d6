"""Under ZeRO-3, a tied input embedding's gradient goes into the weight's gradient partition directly.

    tied = defer_tied_embedding_gradient(engine)  # after deepspeed.initialize; None when it does not apply
    engine.backward(loss)
    tied.add_to_gradient_partition()                # after every backward, before engine.step()

With `share_decoder_input_output_embed` the weight is used twice: the input embedding (first in
the forward) and the output projection (first in the backward). Autograd sums the two gradients
before it calls the weight's accumulator, that is when the backward reaches the embedding, last.
Under ZeRO-3 each rank then holds, at the end of its backward: the output projection's whole
(vocabulary shard x width) gradient, kept since the backward began; the weight gathered again,
because ZeRO-3 gathers a module's parameters before its backward although an embedding's
backward never reads them; and the embedding's own dense gradient. Three whole-weight tensors,
412 MB each for OPT's 50272 x 2048 in fp32, at the peak of every step.

Here the embedding looks its tokens up without autograd reaching the weight (so ZeRO-3 has no
backward to gather it for); its output becomes a leaf whose gradient (tokens x width) is kept.
The weight's only autograd gradient is then the output projection's, which ZeRO-3 reduces and
frees as soon as it is made. After the engine's backward (all of ZeRO-3's reductions done), the
embedding's rows are added into this rank's partition of the weight's gradient through
DeepSpeed's public `safe_get_local_grad` / `safe_set_local_grad`, averaged over the
data-parallel group as ZeRO-3 averages. The rows travel as (token, gradient row) pairs
all-gathered over the group while the group's tokens are fewer than the rows of the vocabulary
shard (training on a few ranks), else as a dense reduce-scatter of the shard, which is what
ZeRO-3 itself would send (opt_175b on 1024 ranks: 128 x 2048 tokens against 6,284 rows).
"""

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from metaseq_ds.distributed import utils as dist_utils


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
    if isinstance(embedding, nn.Embedding):
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            return None  # their gradients are not plain sums of rows
        return TiedEmbeddingGradient(embedding, vocab_start=0, padding_idx=embedding.padding_idx)
    if hasattr(embedding, "vocab_start_index"):  # DeepSpeed's VocabParallelEmbedding: a vocabulary shard
        local_padding = embedding.padding_idx
        padding_idx = None if local_padding is None else local_padding + embedding.vocab_start_index
        return TiedEmbeddingGradient(embedding, vocab_start=embedding.vocab_start_index, padding_idx=padding_idx,
                                     scale=getattr(embedding, "embed_scale", None))
    return None


class TiedEmbeddingGradient:
    """The embedding's side of a tied weight's gradient, kept in the backward and added after it."""

    def __init__(self, embedding: nn.Module, vocab_start: int, padding_idx: Optional[int],
                 scale: Optional[torch.Tensor] = None):
        self.weight = embedding.weight
        self.vocab_start, self.padding_idx, self.scale = vocab_start, padding_idx, scale
        self.rows = self.weight.ds_shape[0]  # the shard's rows (the parameter itself is partitioned)
        self.width = self.weight.ds_shape[1]
        self.group = dist_utils.get_data_parallel_group()
        self.group_size = dist_utils.get_data_parallel_world_size()
        self.group_rank = dist_utils.get_data_parallel_rank()
        self._kept: List[Tuple[torch.Tensor, torch.Tensor]] = []
        # The lookup runs without autograd: ZeRO-3's hooks (registered by the engine, so run
        # before ours) see an output that needs no backward, and ours then makes it a leaf.
        embedding.forward = torch.no_grad()(embedding.forward)
        embedding.register_forward_hook(self._output_as_leaf)

    def _output_as_leaf(self, module: nn.Module, inputs, output: torch.Tensor) -> Optional[torch.Tensor]:
        if not (module.training and torch.is_grad_enabled()):
            return None
        tokens = inputs[0]
        leaf = output.detach().requires_grad_()
        leaf.register_hook(lambda grad: self._kept.append((tokens, grad)))
        return leaf

    @torch.no_grad()
    def add_to_gradient_partition(self) -> None:
        """Add the kept rows (summed over the data-parallel group, divided by its size) to this
        rank's partition of the weight's gradient. Every rank of the group must call it, also one
        that kept nothing."""
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        partition = safe_get_local_grad(self.weight)  # flat: this rank's slice of the padded weight
        rows, grads = self._local_rows(partition.device)
        if self.group_size == 1:
            _add_rows(partition, 0, self.width, rows, grads)
        else:
            count = torch.tensor([rows.numel()], dtype=torch.long, device=partition.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            if int(count) * self.group_size < self.rows:
                rows, grads = self._all_gathered(rows, grads, int(count))
                _add_rows(partition, self.group_rank * partition.numel(), self.width, rows, grads / self.group_size)
            else:
                partition += self._reduce_scattered(rows, grads, partition.numel()) / self.group_size
        safe_set_local_grad(self.weight, partition)

    def _local_rows(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(n,) rows of this shard and their (n, width) fp32 gradients, from what the backward kept."""
        kept, self._kept = self._kept, []
        if not kept:
            return torch.empty(0, dtype=torch.long, device=device), torch.empty(0, self.width, device=device)
        tokens = torch.cat([t.reshape(-1) for t, _ in kept])
        grads = torch.cat([g.reshape(-1, self.width) for _, g in kept]).float()
        if self.scale is not None:
            grads = grads * self.scale.float()
        keep = (tokens >= self.vocab_start) & (tokens < self.vocab_start + self.rows)
        if self.padding_idx is not None:
            keep &= tokens != self.padding_idx  # the padding row gets no gradient (nn.Embedding's rule)
        return (tokens[keep] - self.vocab_start).to(device), grads[keep].to(device)

    def _all_gathered(self, rows: torch.Tensor, grads: torch.Tensor, count: int) -> Tuple[torch.Tensor, torch.Tensor]:
        padded_rows = torch.full((count,), -1, dtype=torch.long, device=rows.device)
        padded_rows[: rows.numel()] = rows
        padded_grads = torch.zeros(count, self.width, device=grads.device)
        padded_grads[: rows.numel()] = grads
        all_rows = [torch.empty_like(padded_rows) for _ in range(self.group_size)]
        all_grads = [torch.empty_like(padded_grads) for _ in range(self.group_size)]
        dist.all_gather(all_rows, padded_rows, group=self.group)
        dist.all_gather(all_grads, padded_grads, group=self.group)
        rows, grads = torch.cat(all_rows), torch.cat(all_grads)
        real = rows >= 0
        return rows[real], grads[real]

    def _reduce_scattered(self, rows: torch.Tensor, grads: torch.Tensor, partition_numel: int) -> torch.Tensor:
        dense = torch.zeros(partition_numel * self.group_size, device=grads.device)
        dense[: self.rows * self.width].view(self.rows, self.width).index_add_(0, rows, grads)
        mine = torch.empty(partition_numel, device=grads.device)
        dist.reduce_scatter_tensor(mine, dense, group=self.group)
        return mine


def _add_rows(partition: torch.Tensor, start: int, width: int, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """partition (the flat elements [start, start + numel) of the weight) += each row's gradient."""
    if rows.numel() == 0:
        return
    end = start + partition.numel()
    touching = (rows * width < end) & ((rows + 1) * width > start)
    rows, grads = rows[touching], grads[touching]
    offsets = rows[:, None] * width + torch.arange(width, device=rows.device) - start  # flat positions in the partition
    inside = (offsets >= 0) & (offsets < partition.numel())
    partition.index_add_(0, offsets[inside], grads[inside].to(partition.dtype))
