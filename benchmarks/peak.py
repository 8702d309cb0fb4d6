"""What this machine can do: sustained matmul GFLOP/s (fp32, bf16) and memory copy bandwidth.

    python -m benchmarks.peak [--seconds 2] [--threads N] [--device cuda]

These are the denominators of the training benchmark's MFU (model FLOPs / s over the matmul
peak of the same dtype). Each figure is the median of repeated timings over about `--seconds`,
with torch's default threads (all cores) unless `--threads`; matmuls are square. Both of
PyTorch's CPU matmul libraries are timed: `torch.mm` (MKL for fp32, oneDNN for bf16) and
oneDNN directly (`metaseq_ds.private_apis.torch_ops.onednn_linear`, what `metaseq_ds.modules.Linear` uses
for fp32). The peak is the best of all: what the hardware sustains on the most favourable
shape and library. On CUDA (`--device cuda`) torch.mm (cuBLAS) at n = 4096 and 8192, timed to the
device's completion, and a 1 GiB device-to-device copy.
"""

import argparse
import statistics
import time
from typing import Callable, Dict, Tuple

import torch

from metaseq_ds.private_apis.torch_ops import cpu_has_bf16_matmul, onednn_linear

SIZES = {"cpu": (1024, 2048, 4096), "cuda": (4096, 8192)}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], seconds: float, device: str = "cpu") -> float:
    fn()  # warm-up: allocation, kernel choice, caches
    synchronize(device)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 3:
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(size: int, dtype: torch.dtype, library: str, seconds: float, device: str = "cpu") -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, dtype=dtype, device=device)

    def product():
        if library == "torch.mm":
            return torch.mm(a, b, out=out)
        return onednn_linear(a, b)  # a @ b.T

    return 2 * size**3 / median_seconds(product, seconds, device) / 1e9


def copy_gbytes_per_s(seconds: float, megabytes: int = 256, device: str = "cpu") -> float:
    """Read + write bytes per second of a large tensor copy (far beyond the caches)."""
    src = torch.randn(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / median_seconds(lambda: dst.copy_(src), seconds, device) / 1e9


def libraries(device: str = "cpu"):
    return ("torch.mm", "oneDNN") if device == "cpu" and torch.backends.mkldnn.is_available() else ("torch.mm",)


def dtypes(device: str = "cpu") -> Tuple[str, ...]:
    """The dtypes this device multiplies at speed: bf16 only where it has bf16 kernels (an AVX2
    CPU has none: one 4096 x 4096 bf16 product takes minutes, and oneDNN refuses bf16)."""
    return ("fp32", "bf16") if device == "cuda" or cpu_has_bf16_matmul() else ("fp32",)


def measure(seconds: float, device: str = "cpu") -> Dict[str, object]:
    """{("fp32", library): {size: GFLOP/s}, ..., "peak_fp32", "peak_bf16", "copy_GBps"} of `device`
    ("peak_bf16" None where the device has no bf16 kernels: `dtypes`)."""
    result: Dict[str, object] = {"peak_bf16": None}
    for name in dtypes(device):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        for library in libraries(device):
            result[name, library] = {size: matmul_gflops(size, dtype, library, seconds, device) for size in SIZES[device]}
        result[f"peak_{name}"] = max(max(result[name, library].values()) for library in libraries(device))
    result["copy_GBps"] = copy_gbytes_per_s(seconds, 1024 if device == "cuda" else 256, device)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = measure(args.seconds, args.device)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}")
    print(f"{'matmul n x n @ n x n':<26}" + "".join(f"{f'n={n}':>10}" for n in SIZES[args.device]))
    for name in dtypes(args.device):
        for library in libraries(args.device):
            label = f"{name} {library} GFLOP/s"
            print(f"{label:<26}" + "".join(f"{result[name, library][n]:>10.1f}" for n in SIZES[args.device]))
    print(f"{'copy GB/s (rd + wr)':<26}{result['copy_GBps']:>10.1f}")
    bf16 = (f"bf16 {result['peak_bf16']:.1f} GFLOP/s ({result['peak_bf16'] / result['peak_fp32']:.1f}x)"
            if result["peak_bf16"] else "bf16 not measured (this CPU has no bf16 matmul kernels)")
    print(f"summary: peak matmul fp32 {result['peak_fp32']:.1f} GFLOP/s, {bf16}, copy {result['copy_GBps']:.1f} GB/s")


if __name__ == "__main__":
    main()
