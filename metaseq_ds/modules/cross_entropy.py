"""Cross entropy over a large vocabulary without (N, V) temporaries (fairseq's `modules.cross_entropy`),
and the output projection fused with it, without the (N, V) logits.

    losses = cross_entropy(logits.view(-1, V), target.view(-1), ignore_index=pad)  # (N,) fp32
    loss, losses = head(features, target=target, ignore_index=pad)  # head: a VocabularyProjection

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
"""

from typing import Tuple

import torch
import torch.nn.functional as F

from metaseq_ds.modules.linear import Linear, product

BLOCK_ELEMENTS = 1 << 21  # fp32 working block of 8 MiB on the CPU: fits its L3 with room to spare
# Logits of one chunk of `linear_cross_entropy` (128 MiB in fp32): rows enough for efficient
# products (667 at OPT's 50272 words), few chunks to accumulate the weight's gradient over.
# Also the working block off the CPU: a GPU has no cache to fit, and each block costs ~6 kernel
# launches (CPU-sized blocks would make ~2,400 a step at OPT-1.3b's 8 x 2048 tokens).
CHUNK_ELEMENTS = 1 << 25


def _row_blocks(logits: torch.Tensor):
    """Slices of consecutive rows of about BLOCK_ELEMENTS elements each (CHUNK_ELEMENTS off the CPU)."""
    rows, vocab = logits.shape
    step = max(1, (BLOCK_ELEMENTS if logits.device.type == "cpu" else CHUNK_ELEMENTS) // vocab)
    return (slice(start, start + step) for start in range(0, rows, step))


def _safe_targets(target: torch.Tensor, ignore_index: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N,) rows that count, and (N, 1) targets with a valid index in every row."""
    keep = target.ne(ignore_index)
    return keep, target.masked_fill(~keep, 0)[:, None]


def _log_normalizers(logits: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 logsumexp of each row of the (N, V) logits, a block of rows at a time."""
    log_normalizer = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    for rows in _row_blocks(logits):
        log_normalizer[rows] = torch.logsumexp(logits[rows].float(), dim=1)
    return log_normalizer


def _into_gradient_(logits: torch.Tensor, log_normalizer: torch.Tensor, safe_target: torch.Tensor,
                    scale: torch.Tensor) -> None:
    """Overwrite the (N, V) logits with d loss / d logits = (softmax - onehot(target)) * scale
    ((N, 1) fp32), recomputed in fp32 a block of rows at a time."""
    for rows in _row_blocks(logits):
        block = logits[rows]  # (n, V), a view into the logits
        work = block.float()  # the view itself for fp32 logits, an fp32 copy otherwise
        work.sub_(log_normalizer[rows, None]).exp_().mul_(scale[rows])
        work.scatter_add_(1, safe_target[rows], -scale[rows])
        if work.data_ptr() != block.data_ptr():
            block.copy_(work)


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


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int):
        keep, safe_target = _safe_targets(target, ignore_index)
        want_features, want_weight = ctx.needs_input_grad[:2]
        losses = torch.empty(features.size(0), dtype=torch.float32, device=features.device)  # (N,)
        features_grad = torch.empty_like(features) if want_features else None  # (N, C)
        weight_grad = None  # (V, C), from the first chunk on
        step = max(1, CHUNK_ELEMENTS // weight.size(0))
        for start in range(0, features.size(0), step):
            rows = slice(start, start + step)
            logits = product(features[rows], weight)  # (n, V)
            log_normalizer = _log_normalizers(logits)
            losses[rows] = log_normalizer - logits.gather(1, safe_target[rows]).squeeze(1).float()
            if not (want_features or want_weight):
                continue
            # The gradient of the summed loss (pads count 0), over the chunk's logits.
            _into_gradient_(logits, log_normalizer, safe_target[rows], keep[rows, None].float())
            if want_features:
                features_grad[rows] = product(logits, weight.t())  # (n, V) @ (V, C)
            if want_weight:
                if weight_grad is None:
                    weight_grad = torch.mm(logits.t(), features[rows])  # (V, n) @ (n, C)
                else:
                    weight_grad.addmm_(logits.t(), features[rows])
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
        return features_grad, weight_grad, None, None


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
    return _LinearCrossEntropy.apply(features, weight, target, ignore_index)


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
