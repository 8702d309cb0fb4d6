"""Whether padding OPT's vocabulary to a multiple of 128, or cutting the weight gradient's product
at a multiple of 64 rows, would speed the output projection and loss.

    python -m benchmarks.vocab_padding [--device cuda --dtype bf16] [--tokens 16384 --dim 2048]

OPT's 50272 words are a multiple of 32 but not of 64: matrix kernels tile the vocabulary
dimension in blocks of 64-256, so the last block of each product runs partly empty, and some
kernels take a slower path for such a size. 50304 is the next multiple of 128 (+32 rows,
+0.06% of the work). This times the fused projection and loss (`linear_cross_entropy`, forward
with its gradients, as a training step runs it) three ways, in turns, median of `--repeats`: at
50272 words with every product whole; at 50272 with the weight gradient's product (the one with
the vocabulary as its rows) cut into the rows up to the last multiple of 64 and the rest
(`modules.linear.ROW_TILES`, which the loss follows); and at 50304 words. A padded vocabulary
would need its extra rows kept out of the softmax and dropped on export (OPT's checkpoints have
50272). On an AVX-512 CPU, bf16, cutting gains what padding does (the forward and the features'
gradient products gain nothing from either), so the CPU cuts; a GPU's entry in `ROW_TILES` waits
for this benchmark's figures there.
Defaults: OPT-1.3b's training shape (8 x 2048 tokens, width 2048) on a GPU; 1024 tokens on the CPU."""

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from metaseq_ds.modules.cross_entropy import linear_cross_entropy
from metaseq_ds.modules.linear import ROW_TILES

OPT_VOCABULARY, PADDED = 50272, 50304
CUT_TILE = 64
WHOLE, CUT = f"{OPT_VOCABULARY} words", f"{OPT_VOCABULARY} words, weight gradient cut at {CUT_TILE} rows"
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


@contextmanager
def row_tile(device: torch.device, dtype: torch.dtype, tile: int):
    """The weight gradient's products cut at a multiple of `tile` rows (1: whole) on this device."""
    key = (device.type, dtype)
    saved = ROW_TILES.get(key)
    ROW_TILES[key] = tile
    try:
        yield
    finally:
        if saved is None:
            del ROW_TILES[key]
        else:
            ROW_TILES[key] = saved


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
    variants = {  # name: (vocabulary, row tile of the weight gradient's products)
        WHOLE: (OPT_VOCABULARY, 1),
        CUT: (OPT_VOCABULARY, CUT_TILE),
        f"{PADDED} words": (PADDED, 1),
    }
    times = {name: [] for name in variants}
    for repeat in range(args.repeats + 1):  # the first a warm-up: kernels chosen, memory pooled
        for name, (size, tile) in variants.items():
            with row_tile(device, dtype, tile):
                seconds = timed_step(features, weights[size], target)
            if repeat:
                times[name].append(seconds)
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    for name, (size, _) in variants.items():
        flops = 6 * tokens * args.dim * size  # three products of 2 * N * C * V
        print(f"{name}: {median[name] * 1e3:.2f} ms ({flops / median[name] / 1e12:.3g} TFLOP/s), "
              f"runs {', '.join(f'{s * 1e3:.2f}' for s in times[name])} ms")
    # Per word of the vocabulary: the padded product does 0.06% more work for the same 50272 words.
    padded = median[f"{PADDED} words"]
    gain = (median[WHOLE] / OPT_VOCABULARY) / (padded / PADDED)
    print(f"summary: {tokens} tokens x width {args.dim}, {args.dtype} on {device.type}: projection + loss "
          f"{median[WHOLE] * 1e3:.2f} ms at {OPT_VOCABULARY} words, {padded * 1e3:.2f} ms at {PADDED}; "
          f"padded is {median[WHOLE] / padded:.3f}x as fast ({gain:.3f}x per word); the weight gradient cut at "
          f"{CUT_TILE} rows is {median[WHOLE] / median[CUT]:.3f}x as fast", flush=True)


if __name__ == "__main__":
    main()
