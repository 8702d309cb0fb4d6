"""Whether padding OPT's vocabulary to a multiple of 128 would speed the output projection and loss.

    python -m benchmarks.vocab_padding [--device cuda --dtype bf16] [--tokens 16384 --dim 2048]

OPT's 50272 words are a multiple of 32 but not of 64: matrix kernels tile the vocabulary
dimension in blocks of 64-256, so the last block of each product runs partly empty, and some
kernels take a slower path for such a size. 50304 is the next multiple of 128 (+32 rows,
+0.06% of the work). This times the fused projection and loss (`linear_cross_entropy`, forward
with its gradients, as a training step runs it) at both sizes, in turns, median of `--repeats`.
A padded vocabulary would need its extra rows kept out of the softmax and dropped on export
(OPT's checkpoints have 50272): worth building only if this shows a gain on the GPU.
Defaults: OPT-1.3b's training shape (8 x 2048 tokens, width 2048) on a GPU; 1024 tokens on the CPU.
"""

import argparse
import statistics
import time

import torch

from metaseq_ds.modules.cross_entropy import linear_cross_entropy

OPT_VOCABULARY, PADDED = 50272, 50304
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed_step(features: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> float:
    """Seconds of one forward and backward of the fused projection and loss."""
    features.grad = weight.grad = None
    if features.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss, _ = linear_cross_entropy(features, weight, target)
    loss.backward()
    if features.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--tokens", type=int, default=None, help="rows (default 16384 on a GPU, 1024 on the CPU)")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokens = args.tokens or (16384 if device.type == "cuda" else 1024)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(tokens, args.dim, generator=generator).to(device, dtype).requires_grad_()
    target = torch.randint(0, OPT_VOCABULARY, (tokens,), generator=generator).to(device)
    weights = {size: (torch.randn(size, args.dim, generator=generator) * 0.02).to(device, dtype).requires_grad_()
               for size in (OPT_VOCABULARY, PADDED)}
    times = {size: [] for size in weights}
    for size, weight in weights.items():  # warm-up: kernels chosen, memory pooled
        timed_step(features, weight, target)
    for _ in range(args.repeats):
        for size, weight in weights.items():
            times[size].append(timed_step(features, weight, target))
    median = {size: statistics.median(seconds) for size, seconds in times.items()}
    flops = {size: 6 * tokens * args.dim * size for size in weights}  # three products of 2 * N * C * V
    for size in weights:
        print(f"vocabulary {size}: {median[size] * 1e3:.2f} ms ({flops[size] / median[size] / 1e12:.3g} TFLOP/s), "
              f"runs {', '.join(f'{s * 1e3:.2f}' for s in times[size])} ms")
    # Per word of the vocabulary: the padded product does 0.06% more work for the same 50272 words.
    gain = (median[OPT_VOCABULARY] / OPT_VOCABULARY) / (median[PADDED] / PADDED)
    print(f"summary: {tokens} tokens x width {args.dim}, {args.dtype} on {device.type}: projection + loss "
          f"{median[OPT_VOCABULARY] * 1e3:.2f} ms at {OPT_VOCABULARY} words, {median[PADDED] * 1e3:.2f} ms at {PADDED}; "
          f"padded is {median[OPT_VOCABULARY] / median[PADDED]:.3f}x as fast ({gain:.3f}x per word)", flush=True)


if __name__ == "__main__":
    main()
