"""torch's private operators and tables (torch 2.13)."""

from typing import Any, Dict

from metaseq_ds.private_apis.verified import relies_on


def _public_linear(x, weight, bias=None):
    """F.linear (torch's public CPU linear: MKL, up to 2x slower than oneDNN on AMD CPUs)"""
    import torch.nn.functional as F

    return F.linear(x, weight, bias)


@relies_on("torch", "torch.ops.mkldnn._linear_pointwise",
           written_for="2.13", cuda=False, fallback=_public_linear,
           why="oneDNN's linear, what inductor lowers nn.Linear to on the CPU, beats F.linear's CPU path "
               "(modules.linear); CPU tensors only; goes when torch makes a fused CPU linear public (related: "
               "https://github.com/pytorch/pytorch/pull/147360)",
           test="tests/test_private_apis.py::test_onednn_linear_equals_f_linear_for_plain_and_transposed_weights")
def onednn_linear(x, weight, bias=None):
    """x @ weight.T (+ bias) on oneDNN, for fp32 CPU tensors; either operand may be a transposed
    view. `torch.ops.mkldnn._linear_pointwise` is the op torch's own inductor lowers linear layers
    to on the CPU; it is not public API."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@relies_on("torch", "torch._weights_only_unpickler._get_allowed_globals",
           written_for="2.13", cuda=True,
           why="the restricted unpickler of old fairseq/metaseq .pt files starts from torch's own weights-only "
               "allow-list, which has no public getter",
           test="tests/test_private_apis.py::test_weights_only_allowed_globals_holds_torchs_tensor_rebuilders")
def weights_only_allowed_globals() -> Dict[str, Any]:
    """The classes and functions `torch.load(weights_only=True)` accepts, by qualified name (its
    tensor rebuild functions among them): the base of our restricted unpickler."""
    from torch import _weights_only_unpickler

    return dict(_weights_only_unpickler._get_allowed_globals())


def _avx512_capability() -> bool:
    """torch's CPU capability being AVX-512 (its highest; oneDNN's bf16 kernels need at least that)"""
    import torch

    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@relies_on("torch", "torch.ops.mkldnn._is_mkldnn_bf16_supported",
           written_for="2.13", cuda=False, fallback=_avx512_capability,
           why="whether this CPU multiplies bf16 at speed (AVX-512 or newer: oneDNN's bf16 kernels; on AVX2 "
               "torch falls back to ~1-9 GFLOP/s, 8-60x below fp32); torch has no public query of it "
               "(torch.backends.cpu.get_cpu_capability names the vector ISA, not oneDNN's bf16 support)",
           test="tests/test_private_apis.py::test_bf16_matmul_support_says_whether_onednn_runs_a_bf16_linear")
def cpu_has_bf16_matmul() -> bool:
    """Whether oneDNN has bf16 matmul kernels for this CPU (native bf16 or AVX-512 conversion):
    the test torch's own CPU tests use before they run bf16 products."""
    import torch

    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
