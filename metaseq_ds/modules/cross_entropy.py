"""Cross entropy over a large vocabulary without (N, V) temporaries (fairseq's `modules.cross_entropy`),
and the output projection fused with it, without the (N, V) logits, also for a vocabulary split
over a tensor-parallel group.

    losses = cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=pad)  # (N,) fp32
    loss, losses = head(features, target=target, ignore_index=pad)  # head: a VocabularyProjection,
                                                                    # or the tensor-parallel head

`F.cross_entropy(logits.float(), ...)` makes three (N, V) fp32 tensors per step besides the
logits: the upcast, the log-softmax it saves for backward, and the gradient. With OPT's
50272-token vocabulary those dominate a small model's non-matmul time, much of it in page
faults on fresh memory. Here the forward keeps one fp32 log-normaliser per row, computed a
few rows at a time (a cache-sized block); the backward recomputes the softmax block by block
in fp32 and writes the gradient `(softmax - onehot) * grad` over the logits themselves, which
nothing needs by then. Each gradient element is rounded once, as with an fp32 softmax.
About 3x faster than the upcast path for bf16 logits and 1.7x for fp32 (2048 x 50272).

`linear_cross_entropy` goes further: the logits (1.65 GB in bf16 at OPT-1.3b's 8 x 2048 tokens)
never exist whole. It projects a chunk of rows at a time (`CHUNK_ELEMENTS` logits), takes their
losses and, when a gradient is wanted, turns the chunk into its gradient in place and multiplies
it out at once into the features' gradient and the weight's (accumulated over the chunks, in the
weight's dtype: rounded once a chunk in bf16). The backward only scales the two by the loss's
gradient, which is why the fused loss is the sum over the rows (the per-row losses come out
detached, for logging). Same products and elementwise work as projection + `cross_entropy`.

`vocab_parallel_linear_cross_entropy` is the same over a tensor-parallel vocabulary (the head
of `distributed.tensor_parallel`, whose forward calls it given targets): each rank projects its
features (the same on every rank) onto its own (V/p, C) rows only, a chunk at a time. Per chunk
one all-gather of each rank's fp32 log-normalisers and target logits (0 where the target is
elsewhere) gives every rank the whole vocabulary's, hence the same losses; the softmax is then
the shard's part of the whole row's, and the gradient of the shard's logits (the onehot only
where the shard holds the target) gives this rank's rows of the weight's gradient and its part
of the features', summed over the group once after the last chunk. Neither the (N, V) logits
nor the whole (N, V/p) shard of them exist, only a chunk's; and the loss itself sends (2, rows)
a chunk over the group, where the logits path gathers the logits or, reading the shards,
all-reduces three (N,) vectors.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from metaseq_ds.modules.linear import Linear, product, transposed_product_

BLOCK_ELEMENTS = 1 << 21  # fp32 working block of 8 MiB on the CPU: fits its L3 with room to spare
# Logits of one chunk of `linear_cross_entropy` (128 MiB in fp32): rows enough for efficient
# products (667 at OPT's 50272 words), few chunks to accumulate the weight's gradient over.
# Also the working block off the CPU: a GPU has no cache to fit, and each block costs ~6 kernel
# launches (CPU-sized blocks would make ~2,400 a step at OPT-1.3b's 8 x 2048 tokens).
CHUNK_ELEMENTS = 1 << 25


def _block_rows(logits: torch.Tensor) -> int:
    """Rows of about BLOCK_ELEMENTS elements (CHUNK_ELEMENTS off the CPU) of the (N, V) logits."""
    return max(1, (BLOCK_ELEMENTS if logits.device.type == "cpu" else CHUNK_ELEMENTS) // logits.size(1))


def _row_blocks(logits: torch.Tensor):
    """Slices of consecutive rows of `_block_rows` each."""
    step = _block_rows(logits)
    return (slice(start, start + step) for start in range(0, logits.size(0), step))


def _work_buffer(logits: torch.Tensor) -> torch.Tensor:
    """An fp32 block of the (N, V) logits' rows, for the softmax's temporaries: one buffer for all
    the blocks. Fresh temporaries each block (torch.logsumexp's, an upcast of bf16 logits) cost
    their page faults on the CPU, as a block is above glibc's mmap threshold (`host_memory`):
    2.7x the time of the log-normalisers of fp32 logits, measured at (41, 50272)."""
    return torch.empty(min(logits.size(0), _block_rows(logits)), logits.size(1), dtype=torch.float32,
                       device=logits.device)


def _safe_targets(target: torch.Tensor, ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N,) rows that count, and (N, 1) targets with a valid index in every row."""
    keep = target.ne(ignore_index)
    return keep, target.masked_fill(~keep, 0)[:, None]


def _row_max(block: torch.Tensor) -> torch.Tensor:
    """(n, 1) fp32 largest logit of each row of the (n, V) block, 0 where it is infinite (a row all
    -inf then gives exp(-inf) = 0 throughout, not NaN)."""
    row_max = block.amax(1, keepdim=True).float()
    return row_max.masked_fill_(row_max.isinf(), 0.0)


def _minus(block: torch.Tensor, column: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """The (n, V) block minus the (n, 1) fp32 column, in fp32, in `work`'s first n rows. On the
    CPU a bf16 block is upcast by an explicit copy: `torch.sub` into an fp32 `out` there upcasts it
    into a fresh temporary first, and pays its page faults (a GPU casts as it reads)."""
    out = work[: block.size(0)]
    if block.dtype == torch.float32 or block.device.type != "cpu":
        return torch.sub(block, column, out=out)
    return out.copy_(block).sub_(column)


def _log_normalizers(logits: torch.Tensor, work: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(N,) fp32 logsumexp of each row of the (N, V) logits, a block of rows at a time, computed as
    torch.logsumexp does (rows all -inf give -inf) in `work` (a `_work_buffer`; None: a new one)."""
    work = _work_buffer(logits) if work is None else work
    log_normalizer = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    for rows in _row_blocks(logits):
        block = logits[rows]
        row_max = _row_max(block)
        shifted = _minus(block, row_max, work).exp_()
        log_normalizer[rows] = shifted.sum(1).log_().add_(row_max.squeeze(1))
    return log_normalizer


def _normalizers_and_gradient_(logits: torch.Tensor, safe_target: torch.Tensor, scale: torch.Tensor,
                               work: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`_log_normalizers(logits)`, and the logits overwritten as `_into_gradient_` does (with
    `target_scale` = `scale`), in one pass over each block: the softmax is the block's
    exp(x - max) divided by its sum, where the two apart take every exponential twice (and, for
    bf16 logits, upcast every block twice). For a whole vocabulary: a shard's normalisers must
    first be combined with the other shards'."""
    upcast = logits.dtype != torch.float32
    if upcast and work is None:
        work = _work_buffer(logits)
    log_normalizer = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    tiny = torch.finfo(torch.float32).tiny
    for rows in _row_blocks(logits):
        block = logits[rows]  # (n, V), a view into the logits
        row_max = _row_max(block)
        shifted = (_minus(block, row_max, work) if upcast else block.sub_(row_max)).exp_()
        sums = shifted.sum(1, keepdim=True)  # (n, 1), >= 1 unless the row is all -inf (then 0)
        log_normalizer[rows] = sums.log().add_(row_max).squeeze(1)
        gradient = shifted.mul_(scale[rows] / sums.clamp_min(tiny))  # an all -inf row: 0, not 0/0
        gradient.scatter_add_(1, safe_target[rows], -scale[rows])
        if upcast:
            block.copy_(gradient)
    return log_normalizer


def _into_gradient_(logits: torch.Tensor, log_normalizer: torch.Tensor, safe_target: torch.Tensor,
                    scale: torch.Tensor, target_scale: Optional[torch.Tensor] = None,
                    work: Optional[torch.Tensor] = None) -> None:
    """Overwrite the (N, V) logits with d loss / d logits = softmax * scale - onehot(target) *
    target_scale ((N, 1) fp32 each; target_scale None: `scale`), recomputed in fp32 a block of
    rows at a time: in place for fp32 logits, else in `work` (a `_work_buffer`; None: a new one)
    and rounded once into the logits. (A vocabulary shard subtracts the onehot only in the rows
    whose target it holds.)"""
    target_scale = scale if target_scale is None else target_scale
    upcast = logits.dtype != torch.float32
    if upcast and work is None:
        work = _work_buffer(logits)
    for rows in _row_blocks(logits):
        block = logits[rows]  # (n, V), a view into the logits
        normalizer = log_normalizer[rows, None]
        gradient = _minus(block, normalizer, work) if upcast else block.sub_(normalizer)
        gradient.exp_().mul_(scale[rows])
        gradient.scatter_add_(1, safe_target[rows], -target_scale[rows])
        if upcast:
            block.copy_(gradient)


class _SoftmaxCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        keep, safe_target = _safe_targets(target, ignore_index)
        log_normalizer = _log_normalizers(logits)  # (N,)
        picked = logits.gather(1, safe_target).squeeze(1).float()  # (N,) the target's logit
        ctx.save_for_backward(logits, safe_target, keep, log_normalizer)
        return (log_normalizer - picked).masked_fill_(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, safe_target, keep, log_normalizer = ctx.saved_tensors
        scale = grad_losses.float().masked_fill(~keep, 0.0)[:, None]  # (N, 1)
        # Written over the logits, which are not needed after this.
        _into_gradient_(logits, log_normalizer, safe_target, scale)
        return logits, None, None


class _VocabularyShard:
    """Where a (V/p, C) weight's rows sit in the vocabulary (from row `start`), and the group of
    ranks (`group`, a tensor-parallel group) that hold the other rows, for the same features."""

    def __init__(self, start: int, group):
        self.start, self.group = start, group
        self.size = torch.distributed.get_world_size(group)

    def targets(self, target: torch.Tensor, keep: torch.Tensor, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(N,) whether this shard holds each row's target (never a pad's), and (N, 1) the
        target's row in the shard (0 where it holds none)."""
        local = target - self.start
        holds = keep & local.ge(0) & local.lt(rows)
        return holds, local.masked_fill(~holds, 0)[:, None]

    def normalizers_and_picked(self, log_normalizer: torch.Tensor, picked: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The whole vocabulary's (n,) log-normalisers and target logits from every shard's:
        `picked` is 0 on the shards without the target. One all-gather of (2, n) per chunk;
        every rank then reduces the same (p, 2, n) in the same order, so the losses are equal
        to the bit on all of them. (The logsumexp of the shards' logsumexps is the whole row's.)"""
        mine = torch.stack([log_normalizer, picked])  # (2, n) fp32
        every = [torch.empty_like(mine) for _ in range(self.size)]
        torch.distributed.all_gather(every, mine, group=self.group)
        every = torch.stack(every)  # (p, 2, n)
        return torch.logsumexp(every[:, 0], dim=0), every[:, 1].sum(0)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                shard: Optional[_VocabularyShard]):
        keep, safe_target = _safe_targets(target, ignore_index)
        # The onehot part of the gradient: in the rows whose target this weight holds (all of
        # them but pads, unless it is a vocabulary shard), at the target's row of the weight.
        holds, safe_target = (keep, safe_target) if shard is None else shard.targets(target, keep, weight.size(0))
        want_features, want_weight = ctx.needs_input_grad[:2]
        want_gradient = want_features or want_weight
        # The whole vocabulary's loss and gradient in one pass a block; a shard needs the group's
        # normalisers before its gradient, so it takes two.
        one_pass = shard is None and want_gradient
        losses = torch.empty(features.size(0), dtype=torch.float32, device=features.device)  # (N,)
        features_grad = torch.empty_like(features) if want_features else None  # (N, C)
        weight_grad = None  # (V, C), from the first chunk on
        # The softmax's fp32 temporaries, from the first chunk on; none for fp32 logits in one
        # pass, which works in place.
        work = None
        wants_work = not (one_pass and weight.dtype == torch.float32)
        # Shards are equal (`options` makes the vocabulary a multiple of the tensor-parallel
        # size), so every rank of a group cuts the same chunks and their collectives pair up.
        step = max(1, CHUNK_ELEMENTS // weight.size(0))
        for start in range(0, features.size(0), step):
            rows = slice(start, start + step)
            logits = product(features[rows], weight)  # (n, V)
            if work is None and wants_work:
                work = _work_buffer(logits)
            picked = logits.gather(1, safe_target[rows]).squeeze(1).float()  # (n,) the target's logit
            if one_pass:
                # The loss and, over the chunk's logits, the gradient of the summed loss (pads count 0)
                losses[rows] = _normalizers_and_gradient_(logits, safe_target[rows], keep[rows, None].float(), work) - picked
            else:
                log_normalizer = _log_normalizers(logits, work)
                if shard is not None:
                    log_normalizer, picked = shard.normalizers_and_picked(log_normalizer, picked.masked_fill_(~holds[rows], 0.0))
                losses[rows] = log_normalizer - picked
                if not want_gradient:
                    continue
                # The whole vocabulary's normalisers known: the gradient over the chunk's logits.
                _into_gradient_(logits, log_normalizer, safe_target[rows], keep[rows, None].float(),
                                holds[rows, None].float(), work)
            if want_features:
                features_grad[rows] = product(logits, weight.t())  # (n, V) @ (V, C)
            if want_weight:
                if weight_grad is None:
                    weight_grad = torch.empty(weight.size(0), features.size(1), dtype=logits.dtype, device=logits.device)
                transposed_product_(weight_grad, logits, features[rows], add=start > 0)  # (V, n) @ (n, C)
        if shard is not None and want_features:
            # Each shard's part of the features' gradient, summed once for all chunks (what the
            # column-parallel projection's backward all-reduces).
            torch.distributed.all_reduce(features_grad, group=shard.group)
        losses.masked_fill_(~keep, 0.0)
        ctx.save_for_backward(features_grad, weight_grad)
        ctx.mark_non_differentiable(losses)
        return losses.sum(), losses

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_losses):
        features_grad, weight_grad = ctx.saved_tensors
        # In place: a fresh weight-sized tensor costs its page faults on the CPU. (A second
        # backward through the graph fails on the saved tensors' versions, as autograd checks.)
        # A 0-dim fp32 factor: bf16 gradients are computed in fp32 and rounded once.
        for grad in (features_grad, weight_grad):
            if grad is not None:
                grad.mul_(grad_loss)
        return features_grad, weight_grad, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-row losses (N,) in fp32 of (N, V) `logits` against (N,) `target`; 0 where target == ignore_index.

    Same values and gradient as `F.cross_entropy(logits.float(), target, reduction="none")`.
    NOTE: the backward pass overwrites `logits` with their gradient: read them before it.
    """
    if logits.dim() != 2 or not logits.is_contiguous() or not logits.is_floating_point():
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="none")
    return _SoftmaxCrossEntropy.apply(logits, target, ignore_index)


def linear_cross_entropy(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100) -> Tuple[torch.Tensor, torch.Tensor]:
    """The summed cross entropy (0-dim fp32, differentiable) of the logits `features @ weight.T`
    ((N, C) features, (V, C) weight) against (N,) `target`, and the (N,) fp32 per-row losses
    (detached; 0 where target == ignore_index), without the (N, V) logits.

    Same values and gradients as `cross_entropy(features @ weight.T, target).sum()`."""
    return _LinearCrossEntropy.apply(features, weight, target, ignore_index, None)


def vocab_parallel_linear_cross_entropy(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        ignore_index: int, vocab_start: int, group) -> Tuple[torch.Tensor, torch.Tensor]:
    """`linear_cross_entropy` for a vocabulary split over the ranks of `group` (tensor
    parallelism): `weight` (V/p, C) is this rank's rows of the vocabulary from row `vocab_start`,
    `features` (N, C) and `target` (N,) (indices into the whole vocabulary) are the same on every
    rank of the group, and every rank must call it. Returns the same on every rank: the summed
    loss over the whole vocabulary (0-dim fp32, differentiable) and the (N,) per-row losses
    (detached; 0 where target == ignore_index), without the (N, V/p) logits.

    The gradients are `linear_cross_entropy`'s over the whole weight: `weight`'s is this rank's
    rows of it, and the features' is whole (summed over the group in the forward, one
    all-reduce). Per chunk of rows, one all-gather of (2, rows) fp32 over the group."""
    return _LinearCrossEntropy.apply(features, weight, target, ignore_index, _VocabularyShard(vocab_start, group))


class BlockwiseCrossEntropy:
    """The cross entropy of the logits `features @ Wᵀ` where W arrives a block of rows at a time,
    twice, and is never whole (ZeRO-3's streamed tied embedding, `distributed.tied_embedding`):

        loss_of = BlockwiseCrossEntropy(features, target, ignore_index)
        for first, block in W's blocks: loss_of.add_block(first, block)      # pass 1: the loss
        losses = loss_of.losses()
        for first, block in W's blocks: w_grad = loss_of.gradient_block(first, block, features_grad)  # pass 2

    Pass 1 keeps each row's log-normaliser over the blocks seen (their logsumexps combined) and its
    target's logit; pass 2, the normalisers whole, makes each block's logits again and turns them
    into their gradient, as `linear_cross_entropy` does a chunk of rows. A block's logits are made
    a chunk of rows at a time (`CHUNK_ELEMENTS`). The same values and gradients as
    `linear_cross_entropy` over the whole W, for a third more products: the logits twice."""

    def __init__(self, features: torch.Tensor, target: torch.Tensor, ignore_index: int):
        self.features = features  # (N, C)
        self.target = target  # (N,)
        self.keep, _ = _safe_targets(target, ignore_index)
        self.log_normalizer = torch.full((features.size(0),), -torch.inf, dtype=torch.float32, device=features.device)
        self.picked = torch.zeros(features.size(0), dtype=torch.float32, device=features.device)

    def _chunks(self, first: int, block: torch.Tensor):
        """Per chunk of rows: (rows, (n,) whether the block holds the row's target, (n, 1) its row
        in the block, 0 where it holds none)."""
        step = max(1, CHUNK_ELEMENTS // block.size(0))
        for start in range(0, self.features.size(0), step):
            rows = slice(start, start + step)
            local = self.target[rows] - first
            holds = self.keep[rows] & local.ge(0) & local.lt(block.size(0))
            yield rows, holds, local.masked_fill(~holds, 0)[:, None]

    def add_block(self, first: int, block: torch.Tensor) -> None:
        """Pass 1, W's rows first .. first + len(block)."""
        for rows, holds, local in self._chunks(first, block):
            logits = product(self.features[rows], block)  # (n, v)
            self.log_normalizer[rows] = torch.logaddexp(self.log_normalizer[rows], _log_normalizers(logits))
            self.picked[rows] += logits.gather(1, local).squeeze(1).float().masked_fill_(~holds, 0.0)

    def losses(self) -> torch.Tensor:
        """(N,) fp32 losses once every block was added; 0 at pads."""
        return (self.log_normalizer - self.picked).masked_fill_(~self.keep, 0.0)

    def gradient_block(self, first: int, block: torch.Tensor, features_grad: torch.Tensor) -> torch.Tensor:
        """Pass 2: the (v, C) fp32 gradient of the summed loss for W's rows first .. first + v, and
        the block's part of the features' gradient added to `features_grad` ((N, C) fp32)."""
        weight_grad = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
        scale = self.keep[:, None].float()
        for rows, holds, local in self._chunks(first, block):
            logits = product(self.features[rows], block)
            _into_gradient_(logits, self.log_normalizer[rows], local, scale[rows], holds[:, None].float())
            features_grad[rows] += product(logits, block.t())  # (n, v) @ (v, C)
            # Summed in fp32, each product in the training dtype
            transposed_product_(weight_grad, logits, self.features[rows])
        return weight_grad


class VocabularyProjection(Linear):
    """The decoder's output projection: a bias-free `Linear` onto the vocabulary (same parameter,
    name and state dict), which given targets returns the loss instead of the logits:

        logits = head(features)                                         # (..., V)
        loss, losses = head(features, target=target, ignore_index=pad)  # see linear_cross_entropy

    The loss is computed inside the module's call, so whatever wraps the call (ZeRO-3 gathering
    the weight in its hooks) sees it as the projection it is."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor, target=None, ignore_index: int = -100):
        if target is None:
            return super().forward(x)
        return linear_cross_entropy(x.reshape(-1, x.size(-1)), self.weight, target.reshape(-1), ignore_index)
