"""`Linear`: an `nn.Linear` whose fp32 products on the CPU run on oneDNN instead of MKL.

PyTorch's fp32 CPU matmul calls MKL, whose kernel dispatch favours Intel processors: on this
project's AMD EPYC it sustains ~170 GFLOP/s where oneDNN (also inside PyTorch, and what
PyTorch already uses for bf16) reaches ~300-400 at the decoder's shapes. So for fp32 on the
CPU the forward and both backward products go through `torch.ops.mkldnn._linear_pointwise`;
everything else (bf16, CUDA, a few rows as in decoding) keeps `F.linear`. Same parameters,
names and state dict as `nn.Linear`, and an `nn.Linear` for isinstance checks, so tensor-
parallel plans and checkpoints see no difference. Results equal F.linear's up to fp32
summation order (~1e-6 relative).
"""

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_MIN_ROWS = 32  # measured: from 32 rows oneDNN is faster; below (decoding), MKL's GEMV is as fast


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ weight.T (+ bias) on oneDNN; either operand may be a transposed (strided) view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_product(x, weight, bias)  # (N, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors  # (N, in), (out, in)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_product(grad, weight.t())  # (N, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            if weight.size(0) >= x.size(0):
                # Wide outputs (the vocabulary projection): (x^T grad)^T keeps the big gradient
                # in the layout oneDNN reads without reordering it.
                grad_weight = onednn_product(x.t(), grad.t()).t().contiguous()
            else:
                grad_weight = onednn_product(grad.t(), x.t())  # (out, N) @ (N, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def onednn_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `onednn_product(x, weight)` may run: fp32 CPU tensors, oneDNN on. Not under
    torch.compile (inductor cannot lower this oneDNN op in PyTorch 2.13), nor under autocast,
    which would then no longer choose the product's dtype."""
    return (
        not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.numel() >= ONEDNN_MIN_ROWS * x.size(-1) and onednn_runs(x, weight)


class Linear(nn.Linear):
    """`nn.Linear`, computed on oneDNN for fp32 CPU tensors of at least ONEDNN_MIN_ROWS rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not uses_onednn(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.size(-1))  # (N, in)
        return _OneDNNLinear.apply(rows, self.weight, self.bias).view(*x.shape[:-1], -1)
