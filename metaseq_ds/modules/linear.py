"""`Linear`: an `nn.Linear` whose fp32 products on the CPU, all but the weight's gradient, run on
oneDNN instead of MKL, and `lay_out_for_decoding`, which stores a model's Linear weights the way
decoding reads fastest.

PyTorch's fp32 CPU matmul calls MKL, whose kernel dispatch favours Intel processors: on this
project's AMD EPYC it sustains ~170 GFLOP/s where oneDNN (also inside PyTorch, and what
PyTorch already uses for bf16) reaches ~300-400 at the decoder's shapes. So for fp32 on the
CPU the forward and the input's gradient go through oneDNN's linear op
(`private_apis.torch_ops.onednn_linear`) when there are many rows (training, prompts) or the
weight is large (a decoding step through the vocabulary projection or a wide FFN, where oneDNN
streams the weight from memory ~1.5-3x faster than MKL's matrix-vector product); the weight's
gradient, a product of two transposed operands, stays on MKL, which reads them without copies.
Everything else (bf16, CUDA, a few rows through a small weight) keeps `F.linear`. Same
parameters, names and state dict as `nn.Linear`, and an `nn.Linear` for isinstance checks, so
tensor-parallel plans and checkpoints see no difference.
Results equal F.linear's up to fp32 summation order (~1e-6 relative).
"""

import torch
import torch.nn.functional as F
from torch import nn

from metaseq_ds.private_apis.torch_ops import onednn_linear

# Measured on the decoder's shapes (benchmarks/generate.py has the end-to-end figures): from 32
# rows oneDNN is faster at any size; below, only for weights of 2**20 elements or more, since
# oneDNN's ~20 us call overhead outweighs its faster reads on smaller ones.
ONEDNN_MIN_ROWS = 32
ONEDNN_MIN_WEIGHT = 2**20


_onednn_product = onednn_linear  # x @ weight.T (+ bias); either operand may be a transposed view


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_product(x, weight, bias)  # (N, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors  # (N, in), (out, in)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_product(grad, weight.t())  # (N, out) @ (out, in)
        if ctx.needs_input_grad[1]:
            # torch.mm (MKL) reads both transposed operands as they are; oneDNN's op would first
            # copy grad.t() into a fresh buffer (page faults and all). Measured in turns, the fp32
            # step is 1-5% faster with MKL here on one process, the same on 2 ranks (benchmarks/RESULTS.md).
            grad_weight = torch.mm(grad.t(), x)  # (out, N) @ (N, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Not under torch.compile (inductor cannot lower this oneDNN op in PyTorch 2.13), nor under
    # autocast, which would then no longer choose the product's dtype.
    return (
        (x.numel() >= ONEDNN_MIN_ROWS * x.size(-1) or weight.numel() >= ONEDNN_MIN_WEIGHT)
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
    )


@torch.no_grad()
def lay_out_for_decoding(model: nn.Module) -> None:
    """Store the weight of every `nn.Linear` in `model` transposed in memory: (in, out)
    contiguous, seen through an (out, in) view, so its shape, values and state dict are
    unchanged (a tied embedding shares the layout).

    A decoding step multiplies a few rows by each weight, which is bound by reading the
    weight; both MKL and oneDNN read this layout ~1.3-1.6x faster than the usual one (measured
    with the weights coming from memory, as they do between steps). It costs no memory: the
    weights are moved, not copied. Only for CPU weights of a model that will no longer be
    trained (`BaseModel.make_generation_fast_` calls it): ZeRO's flat buffers
    holding the old tensors would no longer see the weights. Weights already laid out,
    ZeRO-3-partitioned or not on the CPU are left alone.
    """
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if weight.device.type == "cpu" and weight.is_contiguous() and not hasattr(weight, "ds_id"):
            weight.data = weight.data.t().contiguous().t()


# The multiple of rows a weight's gradient product is fastest at, by device type and dtype.
# oneDNN's bf16 products on the CPU run 20-35% slower when the output's rows are not a multiple
# of 64 (measured on an AVX-512 AMD EPYC at widths 512 and 2048), as a weight's gradient over
# OPT's 50272 words is: its rows up to the last multiple of 64 and the rest, as two products, run
# as fast as a vocabulary padded to 50304 would (3x for a 47-row chunk). Elsewhere no such
# measurement was made (`benchmarks/vocab_padding.py` makes it), and products stay whole.
ROW_TILES = {("cpu", torch.bfloat16): 64}


def _row_parts(rows: int, operand: torch.Tensor):
    """Slices of an output's `rows` that `transposed_product_` computes as separate products: all of
    them at once unless `ROW_TILES`' tile for `operand` leaves a rest."""
    row_tile = ROW_TILES.get((operand.device.type, operand.dtype), 1)
    tiled = rows - rows % row_tile
    return [slice(0, rows)] if tiled in (0, rows) else [slice(0, tiled), slice(tiled, rows)]


def transposed_product_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool = True) -> torch.Tensor:
    """`out` (M, C) += (or, `add` False, =) a.t() @ b for (n, M) `a` and (n, C) `b` (such as a
    weight's gradient from its output's gradient `a` and its input `b`). The product is in the
    operands' dtype; an `out` of another dtype (fp32 sums of bf16 products) gets it added or copied.
    Computed in parts of rows that the matmul runs at full speed (`_row_parts`); returns `out`."""
    for rows in _row_parts(out.size(0), a):
        part = out[rows]
        if part.dtype == a.dtype:
            part.addmm_(a[:, rows].t(), b, beta=1 if add else 0)
        elif add:
            part += torch.mm(a[:, rows].t(), b)
        else:
            part.copy_(torch.mm(a[:, rows].t(), b))
    return out


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(N, in) @ weight.T for a (out, in) weight (or a transposed view), outside autograd: on
    oneDNN where `uses_onednn` says so, else `torch.mm`."""
    return _onednn_product(x, weight) if uses_onednn(x, weight) else torch.mm(x, weight.t())


class Linear(nn.Linear):
    """`nn.Linear`, computed on oneDNN for fp32 CPU tensors of at least ONEDNN_MIN_ROWS rows or
    weights of at least ONEDNN_MIN_WEIGHT elements."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x @ weight.T (+ bias), on oneDNN where `uses_onednn` says so, else `F.linear`. Either way
    autograd saves `weight` itself, never a view of its data: ZeRO-3 can then free a gathered
    weight after the forward by swapping its data (and gather it again for the backward)."""
    if not uses_onednn(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.size(-1))  # (N, in)
    return _OneDNNLinear.apply(rows, weight, bias).view(*x.shape[:-1], -1)
