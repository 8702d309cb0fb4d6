"""Under ZeRO-3, a tied embedding's weight is never gathered whole, and its gradient is made after
the backward, straight into its partitions.

    tied = stream_tied_embedding(engine, recompute_loss)  # after deepspeed.initialize; None when it does not apply
    engine.backward(loss)
    tied.add_to_gradient_partition(first_micro_step)  # after every backward, before engine.step()

With `share_decoder_input_output_embed` one weight W (vocabulary shard x width) is used three
times a step: the input embedding's lookup, the output projection's forward, and its backward.
ZeRO-3 gathered the whole of W for each (206 MB in fp32 for OPT's 50272 x 2048 at TP=2, more
than a layer's share when the vocabulary is large against the width), and autograd summed W's
two gradients before its accumulator ran, when the backward reached the embedding, last: each
rank held W's output-projection gradient through its whole backward, then W gathered again
(ZeRO-3 gathers a module's parameters before its backward, although an embedding's backward
never reads them) and the embedding's dense gradient.

Here ZeRO-3's hooks are taken off the two modules
(`private_apis.deepspeed_optimizers.stop_zero3_gathering`), and they read W a chunk at a time
(`CHUNK_ELEMENTS` for all ranks' slices together): each chunk is the same offsets of every
rank's flat partition, all-gathered over the data-parallel group through DeepSpeed's backend,
and is used and dropped before the next is gathered. The lookup adds each chunk's rows to the
tokens that fall in them; the projection computes each chunk's logits, and its backward the
input gradient from each chunk. Rows a chunk holds only part of are zero-filled blocks whose
parts add up across chunks.

With activations recomputed (`--checkpoint-activations`: the user chose compute for memory),
given targets (the `cross_entropy` criterion, without tensor parallelism, chunks of whole rows),
the projection returns the loss instead of the logits: W's chunks are read twice, once for each
row's log-normaliser over all of W and once to make each chunk's logits again and their gradient
(`modules.cross_entropy.BlockwiseCrossEntropy`): the features' gradient, and W's, reduce-scattered
a chunk at a time into a buffer of this rank's partition, added to the partition after the
backward. That is a third more of the output layer's products (+15% of a step's at the CPU
benchmark's width 512, +5% at OPT-1.3b's) for not keeping the logits and their gradient (at
OPT-1.3b's 8 x 2048 tokens, 1.65 GB in bf16) from the forward to the end of the backward; without
recomputation the logits are kept, as the measured step is faster (benchmarks/RESULTS.md).

Autograd never makes a gradient of W. The lookup runs without autograd and its output becomes a
leaf whose gradient (tokens x width) is kept; the projection is an autograd function whose
backward keeps the gradient of its logits (tokens x vocabulary shard) with its input. After the
engine's backward, W's gradient is made from those in chunks of the same layout: each chunk
is reduce-scattered over the data-parallel group (divided by its size, as ZeRO-3 averages;
through DeepSpeed's backend, on gloo in place) and written into this rank's partition through
DeepSpeed's public `safe_get_local_grad` / `safe_set_local_grad` (overwritten at the first
micro-step of an update, added to after).

A rank never holds more of W or of its gradient than a chunk, at any size, except where a
chunk would cut each rank's slice below `MIN_SLICE_ELEMENTS` (products of a few rows are slow on
a GPU): then a chunk holds whole partitions. At opt_175b on 1024 ranks with TP=8 a rank's
partition of W is 0.6M elements, so W's shard (154 MB in bf16, a third of a layer's share) is
gathered in one chunk, as ZeRO-3 would; at 707M on 4 ranks (TP=2) in seven of at most 32 MB.
"""

from typing import Callable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.modules.linear import transposed_product_

# Elements of one chunk of W or of its gradient, all ranks' slices together (32 MB in fp32)...
CHUNK_ELEMENTS = 2**23
# ... unless each rank's slice would be smaller than this: then whole partitions.
MIN_SLICE_ELEMENTS = 2**20


def stream_tied_embedding(engine, recompute_loss: bool = False) -> Optional["StreamedTiedEmbedding"]:
    """Stream W and defer its gradient for `engine`'s model when it trains under ZeRO-3 on
    several data-parallel ranks with its token embedding tied to its output projection; None
    otherwise (nothing changed). `recompute_loss`: the loss without the logits, W read twice."""
    if engine.zero_optimization_stage() != 3:
        return None
    if dist_utils.get_data_parallel_world_size() == 1:
        # One data-parallel rank holds W whole: nothing to gather or reduce, and the streamed
        # gradient would only serialise the step (and keep the logits' gradient whole).
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
        return StreamedTiedEmbedding(engine, embedding, head, vocab_start=0, padding_idx=embedding.padding_idx,
                                     recompute_loss=recompute_loss)
    if hasattr(embedding, "vocab_start_index"):  # DeepSpeed's VocabParallelEmbedding: a vocabulary shard
        local_padding = embedding.padding_idx
        padding_idx = None if local_padding is None else local_padding + embedding.vocab_start_index
        return StreamedTiedEmbedding(engine, embedding, head, vocab_start=embedding.vocab_start_index,
                                     padding_idx=padding_idx, scale=getattr(embedding, "embed_scale", None),
                                     recompute_loss=recompute_loss)
    return None


def chunk_length(partition_size: int, group_size: int) -> int:
    """Elements of each rank's partition of W in one chunk (the whole partition: W in one chunk)."""
    length = max(CHUNK_ELEMENTS // group_size, MIN_SLICE_ELEMENTS)
    return max(1, min(partition_size, length))


class StreamedTiedEmbedding:
    """W's lookup and projection a chunk at a time, and W's gradient made after the backward."""

    def __init__(self, engine, embedding: nn.Module, head: nn.Module, vocab_start: int, padding_idx: Optional[int],
                 scale: Optional[torch.Tensor] = None, recompute_loss: bool = False):
        from metaseq_ds.modules.linear import linear
        from metaseq_ds.private_apis.deepspeed_optimizers import stop_zero3_gathering
        from metaseq_ds.private_apis.deepspeed_tensor_parallel import tp_forward_saving_the_parameter, tp_vocab_embedding_forward

        self.weight = embedding.weight
        self.vocab_start, self.padding_idx, self.scale = vocab_start, padding_idx, scale
        self.rows, self.width = self.weight.ds_shape  # the shard's (the parameter itself is partitioned)
        self.group = dist_utils.get_data_parallel_group()
        self.group_size = dist_utils.get_data_parallel_world_size()
        self.group_rank = dist_utils.get_data_parallel_rank()
        self._embedded: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (tokens, gradient of their embeddings)
        self._projected: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (projection input, gradient of its logits)
        stop_zero3_gathering(engine, (embedding, head))
        if hasattr(embedding, "vocab_start_index"):
            embedding.forward = torch.no_grad()(tp_vocab_embedding_forward(embedding, self.lookup))
        else:
            embedding.forward = self.lookup
        embedding.register_forward_hook(self._embedding_as_leaf)
        self._loss_gradients: List[torch.Tensor] = []  # the fused loss's W gradients, this rank's partition
        if hasattr(head, "vocab_start_index"):  # DeepSpeed's VocabParallelLinear
            head.forward = tp_forward_saving_the_parameter(head, row_parallel=False, linear=linear, product=self._project)
        elif recompute_loss and self._blocks_hold_whole_rows():
            head.forward = self._project_or_loss  # given targets, the loss without the logits
        else:
            head.forward = self._project

    def _embedding_as_leaf(self, module: nn.Module, inputs, output: torch.Tensor) -> Optional[torch.Tensor]:
        if not (module.training and torch.is_grad_enabled()):
            return None
        tokens = inputs[0]
        leaf = output.detach().requires_grad_()
        leaf.register_hook(lambda grad: self._embedded.append((tokens, grad)))
        return leaf

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        return _StreamedProjection.apply(features, self)

    def _project_or_loss(self, features: torch.Tensor, target: Optional[torch.Tensor] = None, ignore_index: int = -100):
        """The logits; or, given targets, (summed loss, per-row losses) as `VocabularyProjection`
        returns them, from W read twice a chunk at a time (`modules.cross_entropy.BlockwiseCrossEntropy`)."""
        if target is None:
            return self._project(features)
        return _StreamedLinearCrossEntropy.apply(features.reshape(-1, self.width), target.reshape(-1), self, ignore_index)

    def make_loss_gradient(self, loss_of, features_grad: torch.Tensor) -> torch.Tensor:
        """Pass 2 of the fused loss: the features' gradient of the summed loss added to
        `features_grad`; W's returned, reduce-scattered a chunk at a time into a buffer of this
        rank's partition (the backward scales it into `keep_loss_gradient`). Every rank must call it."""
        from deepspeed import comm as deepspeed_comm

        partition_grad = torch.zeros(self.weight.ds_tensor.numel(), dtype=torch.float32, device=features_grad.device)
        for offset, length, blocks in self._gathered_chunks():
            grads = torch.zeros(self.group_size, length, dtype=torch.float32, device=features_grad.device)
            for first, block, flat_start in blocks:  # whole rows: each block is where its gradient goes
                grads.view(-1)[flat_start:flat_start + block.numel()] = loss_of.gradient_block(
                    first, block, features_grad).view(-1)
            mine = grads[self.group_rank]
            if self.group_size > 1:
                deepspeed_comm.reduce_scatter_fn(mine, grads.view(-1), group=self.group)
                mine /= self.group_size
            partition_grad[offset:offset + length] = mine
        return partition_grad

    def keep_loss_gradient(self, partition_grad: torch.Tensor) -> None:
        """W's gradient from the fused loss's backward, added to the partition after the backward."""
        self._loss_gradients.append(partition_grad)

    @torch.no_grad()
    def lookup(self, rows: torch.Tensor) -> torch.Tensor:
        """W's rows `rows` (any shape), a chunk at a time; zeros for rows outside this shard."""
        flat = rows.reshape(-1)
        out = torch.zeros(flat.numel(), self.width, dtype=self.weight.ds_tensor.dtype, device=flat.device)

        def add_rows(first: int, block: torch.Tensor) -> None:
            # Every token reads a row of the block (its own, or row 0 masked to zero) rather than
            # only the tokens that fall in it: finding those (`nonzero`) reads the device, a host
            # sync per chunk on a GPU.
            local = flat - first
            inside = (local >= 0) & (local < block.size(0))
            out.add_(block[local.clamp_(0, block.size(0) - 1)].mul_(inside[:, None]))

        self._each_weight_block(add_rows)
        return out.view(*rows.shape, self.width)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """(tokens, width) -> (tokens, rows): the logits of this shard, a chunk at a time, each
        product written into its columns of the logits (a strided output, which the matmul takes as
        it is: no chunk-sized temporary, which on the CPU also faults in fresh memory, to copy)."""
        # Blocks of whole rows (OPT's widths divide the partitions) write their columns once;
        # otherwise a row's parts add up. (Zeroing fresh logits costs as much as their product.)
        whole_rows = self._blocks_hold_whole_rows()
        shape = (features.size(0), self.rows)
        logits = features.new_empty(shape) if whole_rows else features.new_zeros(shape)

        def put_logits(first: int, block: torch.Tensor) -> None:
            columns = logits[:, first:first + block.size(0)]
            if whole_rows:
                torch.mm(features, block.t(), out=columns)
            else:
                columns.addmm_(features, block.t())

        self._each_weight_block(put_logits)
        return logits

    def project_back(self, logits_grad: torch.Tensor) -> torch.Tensor:
        """(tokens, rows) -> (tokens, width): the gradient of the projection's input, a chunk at a
        time (summed in fp32), each chunk's columns of `logits_grad` read where they are."""
        total = logits_grad.new_zeros(logits_grad.size(0), self.width, dtype=torch.float32)

        def add_product(first: int, block: torch.Tensor) -> None:
            columns = logits_grad[:, first:first + block.size(0)]  # (tokens, v) @ (v, width)
            transposed_product_(total, columns.t(), block)

        self._each_weight_block(add_product)
        return total.to(logits_grad.dtype)

    def keep_projection(self, features: torch.Tensor, logits_grad: torch.Tensor) -> None:
        self._projected.append((features, logits_grad))

    def _blocks_hold_whole_rows(self) -> bool:
        """Whether every chunk's slices start and end at row boundaries."""
        size = self.weight.ds_tensor.numel()
        step = chunk_length(size, self.group_size)
        return step == size or (size % self.width == 0 and step % self.width == 0)

    def _chunks(self, partition_size: int) -> Iterator[Tuple[int, int, List[Tuple[int, int, int]]]]:
        """The chunk plan W's reads and its gradient share: per chunk (offset, length, ranges),
        where each range (rank, start, end) is the flat positions of W that rank's partition holds
        at [offset, offset + length), cut at W's end (empty in the padding after it)."""
        from metaseq_ds.private_apis.deepspeed_optimizers import zero3_partition_start

        step, end_of_weight = chunk_length(partition_size, self.group_size), self.rows * self.width
        for offset in range(0, partition_size, step):
            length = min(step, partition_size - offset)
            starts = [zero3_partition_start(self.weight, rank) + offset for rank in range(self.group_size)]
            yield offset, length, [(rank, start, min(start + length, end_of_weight))
                                   for rank, start in enumerate(starts)]

    def _each_weight_block(self, visit: Callable[[int, torch.Tensor], None]) -> None:
        """visit(first row, block of W's rows from there) over all of W, a chunk at a time; a row a
        chunk holds only part of is zero elsewhere. The blocks are gone when `visit` returns
        (each chunk is gathered into the same buffer). Every rank of the group must call it."""
        for _, _, blocks in self._gathered_chunks():
            for first, block, _ in blocks:
                visit(first, block)

    def _gathered_chunks(self) -> Iterator[Tuple[int, int, List[Tuple[int, torch.Tensor, Optional[int]]]]]:
        """Per chunk, gathered over the group: (offset, length, blocks), each block (first row,
        W's rows from there, where the block starts in the chunk's flat (group, length) layout, or
        None for a block of partial rows, zero-filled). Valid until the next chunk is gathered."""
        from deepspeed import comm as deepspeed_comm

        partition = self.weight.ds_tensor  # flat: this rank's slice of the padded W
        size = partition.numel()
        step = chunk_length(size, self.group_size)
        buffer = None if self.group_size == 1 else partition.new_empty(self.group_size * step)
        for offset, length, ranges in self._chunks(size):
            mine = partition.narrow(0, offset, length)
            if buffer is None:
                slices = mine.view(1, length)
            else:
                slices = buffer[:self.group_size * length].view(self.group_size, length)
                deepspeed_comm.allgather_fn(slices.view(-1), mine, group=self.group)
            if length == size:  # whole partitions: together, W
                yield offset, length, [(0, slices.view(-1)[:self.rows * self.width].view(self.rows, self.width), 0)]
                continue
            blocks = []
            for rank, start, end in ranges:
                if start < end:
                    first, last = self._rows_of(start, end)
                    if start == first * self.width and end == last * self.width:
                        blocks.append((first, slices[rank, :end - start].view(last - first, self.width), rank * length))
                    else:
                        block = slices.new_zeros(last - first, self.width)
                        block.view(-1)[start - first * self.width:end - first * self.width] = slices[rank, :end - start]
                        blocks.append((first, block, None))
            yield offset, length, blocks

    def _rows_of(self, start: int, end: int) -> Tuple[int, int]:
        """The rows that flat positions [start, end) of W fall in: [first, last)."""
        return start // self.width, (end - 1) // self.width + 1

    @torch.no_grad()
    def add_to_gradient_partition(self, first_micro_step: bool) -> None:
        """Make this micro-batch's gradient of W, summed over the data-parallel group and divided
        by its size, in this rank's partition: written at an update's first micro-step, added to
        after. Every rank of the group must call it, also one that kept nothing."""
        from deepspeed import comm as deepspeed_comm
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        partition = safe_get_local_grad(self.weight)  # flat: this rank's slice of the padded W
        # In the training dtype, as autograd would have multiplied them (bf16 products run on oneDNN)
        projected = [(features.reshape(-1, self.width), grad.reshape(-1, self.rows))
                     for features, grad in self._projected]
        rows, row_grads = self._embedded_rows(partition.device)
        loss_gradients = self._loss_gradients  # already summed over the group
        self._projected, self._embedded, self._loss_gradients = [], [], []
        buffer = None  # one for every chunk (the first is the longest): a fresh one costs its page faults on the CPU
        for offset, length, ranges in self._chunks(partition.numel()):
            if buffer is None:
                buffer = torch.empty(self.group_size * length, device=partition.device)
            slices = buffer[: self.group_size * length].view(self.group_size, length).zero_()
            for rank, start, end in ranges:
                self._fill(slices[rank], start, end, projected, rows, row_grads)
            mine = slices[self.group_rank]
            if self.group_size > 1:  # through DeepSpeed's backend: in place on gloo (gloo_collectives)
                deepspeed_comm.reduce_scatter_fn(mine, slices.view(-1), group=self.group)
                mine /= self.group_size
            for grad in loss_gradients:
                mine.add_(grad[offset:offset + length])
            target = partition.narrow(0, offset, length)
            if first_micro_step:
                target.copy_(mine)
            else:
                target.add_(mine)
        safe_set_local_grad(self.weight, partition)

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
        """out[:end - start] = W's gradient at flat positions [start, end), `out` being zero
        (nothing when empty: the padding past W's end stays zero)."""
        if start >= end:
            return
        first, last = self._rows_of(start, end)
        # Whole rows (OPT's shapes): the rows' gradient is summed in `out` itself; else in a block
        # of the rows, of which `out` gets its part.
        whole_rows = start == first * self.width and end == last * self.width
        block = (out[: end - start].view(last - first, self.width) if whole_rows
                 else torch.zeros(last - first, self.width, device=out.device))
        for features, logits_grad in projected:  # summed in fp32, each product in the training dtype
            transposed_product_(block, logits_grad[:, first:last], features)
        inside = (rows >= first) & (rows < last)
        block.index_add_(0, rows[inside] - first, row_grads[inside])
        if not whole_rows:
            out[: end - start] = block.view(-1)[start - first * self.width:end - first * self.width]


class _StreamedProjection(torch.autograd.Function):
    """features @ Wᵀ for this shard's rows, W read a chunk at a time; the backward gives the
    features' gradient and keeps the logits' for W's (no gradient of W through autograd)."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, tied: StreamedTiedEmbedding) -> torch.Tensor:
        ctx.tied = tied
        ctx.save_for_backward(features)
        rows = features.reshape(-1, tied.width)
        return tied.project(rows).view(*features.shape[:-1], tied.rows)

    @staticmethod
    def backward(ctx, logits_grad: torch.Tensor):
        (features,) = ctx.saved_tensors
        ctx.tied.keep_projection(features, logits_grad)
        features_grad = ctx.tied.project_back(logits_grad.reshape(-1, ctx.tied.rows))
        return features_grad.view_as(features), None


class _StreamedLinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of (N, C) features against (N,) targets over this shard's rows,
    W read twice a chunk at a time and no logits kept: the gradients are made in the forward
    (the features' kept for the backward, W's reduce-scattered into a partition buffer), and the
    backward scales them by the loss's gradient, as `modules.cross_entropy.linear_cross_entropy`."""

    @staticmethod
    def forward(ctx, features: torch.Tensor, target: torch.Tensor, tied: StreamedTiedEmbedding, ignore_index: int):
        from metaseq_ds.modules.cross_entropy import BlockwiseCrossEntropy

        loss_of = BlockwiseCrossEntropy(features, target, ignore_index)
        tied._each_weight_block(loss_of.add_block)
        losses = loss_of.losses()
        features_grad = weight_grad = None
        if ctx.needs_input_grad[0]:
            features_grad = torch.zeros(features.shape, dtype=torch.float32, device=features.device)
            weight_grad = tied.make_loss_gradient(loss_of, features_grad)
        ctx.tied, ctx.dtype = tied, features.dtype
        ctx.save_for_backward(features_grad, weight_grad)
        ctx.mark_non_differentiable(losses)
        return losses.sum(), losses

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_losses):
        features_grad, weight_grad = ctx.saved_tensors
        ctx.tied.keep_loss_gradient(weight_grad.mul_(grad_loss))
        return (features_grad * grad_loss).to(ctx.dtype), None, None, None
