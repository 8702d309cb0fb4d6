"""Training throughput and memory: metaseq_ds vs Hugging Face OPTForCausalLM, both on DeepSpeed.

    python -m benchmarks.train [--steps 10] [--warmup 1] [--ranks 1 2] [--dtypes fp32 bf16] [--quick]

The same OPT-style model (default: width 512, 8 layers, 8 heads, FFN 2048, vocabulary 50272,
sequence 512, micro-batch 4 per rank), the same random tokens, the same DeepSpeed config
(derived by metaseq_ds from one set of `mseq train` flags: ZeRO-0 for one process, ZeRO-3 for
2 ranks under `deepspeed --num_gpus 2` with one thread per rank) and AdamW with the same
hyper-parameters on both sides: metaseq_ds's `--adam-impl` (default: torch's fused kernel on
the CPU), Hugging Face's users' `torch.optim.AdamW`; see `benchmarks/train_worker.py` for what
each side runs. The two sides run side by side and
take turns step by step (A B B A ...), so a change in the machine's load hits both alike:
the ratio is the figure to read, absolute times move with the load.

Per (ranks, dtype): median seconds per step over `--steps` steps after `--warmup`, tokens/s
(all ranks), peak RSS per rank, MFU, and the ratio metaseq_ds / HF of tokens/s (with
`--hf-compiled`, HF also with its decoder layers compiled, and the ratio against the faster
HF side). Then, for
the ZeRO-3 runs, the model-state bytes a rank holds against the exact count and DeepSpeed's
estimator. Targets: ratio >= 1.2 everywhere; MFU for bf16 in one process >= 50% on the CPU (issue 6),
>= 55% on a GPU (issue 34);
model states within 10% of theory.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from benchmarks import peak
from benchmarks.train_worker import VOCAB, add_run_arguments, run_flags
from benchmarks.zero_memory import estimated_bytes, exact_state_bytes
from metaseq_ds.distributed.deepspeed_config import SLOW_BF16

NAMES = {"ours": "metaseq_ds", "hf": "HF + DS", "hf_compiled": "HF compiled"}
ROOT = Path(__file__).resolve().parent.parent
MFU_FORMULA = (
    "MFU = model FLOP/s / matmul peak of the dtype (benchmarks/peak.py: all cores and the best library, or the GPU); "
    "model FLOPs per token = 6*N + 12*L*d*T, N = parameters of the L layers and the final LayerNorm "
    "plus the V x d output projection (tied to the token embedding, counted once), without the position table and the "
    "embedding lookup; 12*L*d*T = attention scores and weighted sum, forward and backward, causal "
    "mask not discounted"
)


def flops_per_token(dim: int, layers: int, ffn: int, seq: int) -> int:
    per_layer = 4 * dim * dim + 4 * dim + 2 * dim * ffn + ffn + dim + 4 * dim  # q/k/v/out, fc1/fc2, 2 LayerNorms
    n = layers * per_layer + 2 * dim + VOCAB * dim
    return 6 * n + 12 * layers * dim * seq


def launch(side: str, ranks: int, dtype: str, folder: Path, port: int, args) -> subprocess.Popen:
    worker = ["--side", side, "--dtype", dtype, "--out", str(folder), "--steps", str(args.steps),
              "--warmup", str(args.warmup), *run_flags(args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if ranks == 1:
        cmd = [sys.executable, "-m", "benchmarks.train_worker", *worker]
    else:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))  # see DEEPSPEED_CPU.md
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--no_local_rank",
               "--master_port", str(port), "--module", "benchmarks.train_worker", *worker]
    with open(folder / f"{side}.log", "w") as log:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(path: Path, side: str, procs: Dict[str, subprocess.Popen], folder: Path) -> None:
    """Until `side`'s worker creates `path`; if it ends first, stop both and show its log."""
    while not path.exists():
        if procs[side].poll() is not None and not path.exists():
            for proc in procs.values():
                proc.kill()
            tail = (folder / f"{side}.log").read_text()[-4000:]
            sys.exit(f"the {side} worker stopped (exit {procs[side].returncode}) before {path.name}:\n{tail}")
        time.sleep(0.005)


def sides(args) -> Tuple[str, ...]:
    """metaseq_ds and HF, and HF with its layers compiled where asked for (`--hf-compiled`)."""
    return ("ours", "hf", "hf_compiled") if args.hf_compiled else ("ours", "hf")


def run_pair(ranks: int, dtype: str, args) -> Dict[str, List[dict]]:
    """The sides side by side, stepping in turns; {side: [rank results]}."""
    names = sides(args)
    ports = dict(zip(names, random.sample(range(20000, 40000), len(names))))
    with tempfile.TemporaryDirectory(prefix="bench-train-") as name:
        folder = Path(name)
        procs = {side: launch(side, ranks, dtype, folder, ports[side], args) for side in names}
        for side in names:
            wait_for(folder / f"ready.{side}", side, procs, folder)
        for step in range(args.warmup + args.steps):
            for side in names if step % 2 == 0 else reversed(names):  # A B, B A: none always goes first
                (folder / f"go.{step}.{side}").touch()
                wait_for(folder / f"done.{step}.{side}", side, procs, folder)
        for side in names:
            for rank in range(ranks):
                wait_for(folder / f"{side}.rank{rank}.json", side, procs, folder)
        for proc in procs.values():
            proc.wait()  # the results are in; a launcher's exit code is not (DEEPSPEED_CPU.md)
        return {side: [json.loads((folder / f"{side}.rank{r}.json").read_text()) for r in range(ranks)]
                for side in names}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def print_throughput(rows, peaks, args) -> List[str]:
    per_token = flops_per_token(args.dim, args.layers, args.ffn, args.seq)
    kind = rows[0][1]["ours"][0]["memory_kind"]
    print(f"{'ranks':>5} {'dtype':>5} {'side':>11} {'s/step':>7} {'tokens/s':>9} {f'peak {kind}/rank GiB':>17} "
          f"{'MFU':>6} {'ours/HF':>7}")
    verdicts, mfu_verdicts = [], []
    for (ranks, dtype), results in rows:
        speed = {}
        for side in results:
            rank0 = results[side][0]
            seconds = statistics.median(rank0["seconds"])
            speed[side] = rank0["tokens_per_step"] / seconds
            mfu = speed[side] * per_token / (peaks[f"peak_{dtype}"] * 1e9)
            rss = max(r["peak_memory"] for r in results[side])
            ratio = f"{speed['ours'] / speed[side]:>6.2f}x" if side != "ours" else ""
            print(f"{ranks:>5} {dtype:>5} {NAMES[side]:>11} {seconds:>7.2f} {speed[side]:>9.0f} {gib(rss):>17} "
                  f"{mfu:>6.1%} {ratio:>7}")
            if side == "ours" and ranks == 1 and dtype == "bf16":
                target = 0.55 if peaks["device"] == "cuda" else 0.5
                mfu_verdicts.append(f"MFU bf16 1 process {mfu:.1%} ({'meets' if mfu >= target else 'misses'} {target:.0%})")
        # Against the faster Hugging Face side (eager, or compiled with --hf-compiled).
        ratio = speed["ours"] / max(speed[side] for side in speed if side != "ours")
        verdicts.append(f"{ranks}x{dtype} {ratio:.2f}x ({'meets' if ratio >= 1.2 else 'misses'} 1.2x)")
    print(f"model FLOPs per token {per_token / 1e6:.1f} M; {MFU_FORMULA}")
    bf16 = f"{peaks['peak_bf16']:.0f} GFLOP/s" if peaks["peak_bf16"] else "not measured"
    print(f"matmul peak (the better of a measurement before and one after the runs): "
          f"fp32 {peaks['peak_fp32']:.0f} GFLOP/s, bf16 {bf16}")
    return verdicts + mfu_verdicts


def print_memory(rows) -> List[str]:
    """Model states per rank of the ZeRO-3 runs: measured, exact count, DeepSpeed's estimator."""
    zero3 = [(key, results) for key, results in rows if "model_states" in results["ours"][0]]
    if not zero3:
        return []
    print("\nZeRO-3 model states per rank, MiB: measured (params + grads + fp32 master + Adam moments, "
          "after a step) vs the exact count (dtype bytes per parameter / ranks) and DeepSpeed's "
          "estimate_zero3_model_states_mem_needs (18 B per parameter / ranks; its largest-layer term, "
          "a transient gather, apart)")
    print(f"{'ranks':>5} {'dtype':>5} {'side':>11} {'params':>7} {'grads':>7} {'master':>7} {'Adam':>7} "
          f"{'total':>7} {'exact':>7} {'ratio':>6} {'DS est.':>8} {'ratio':>6}")
    verdicts = []
    for (ranks, dtype), results in zero3:
        for side in results:
            states = results[side][0]["model_states"]
            exact = exact_state_bytes(states["total_params"], dtype) / ranks
            estimate = estimated_bytes(states["total_params"], states["largest_layer_params"], ranks)
            mib = [states[k] / 2**20 for k in ("params", "grads", "master", "optimizer", "total")]
            print(f"{ranks:>5} {dtype:>5} {NAMES[side]:>11} " + " ".join(f"{m:>7.1f}" for m in mib)
                  + f" {exact / 2**20:>7.1f} {states['total'] / exact:>5.2f}x"
                  + f" {estimate['partitioned'] / 2**20:>8.1f} {states['total'] / estimate['partitioned']:>5.2f}x")
            if side == "ours":
                ratio = states["total"] / exact
                verdicts.append(f"ZeRO-3 {dtype} states {ratio:.2f}x exact, "
                                f"{states['total'] / estimate['partitioned']:.2f}x DeepSpeed's estimate "
                                f"({'within' if abs(ratio - 1) <= 0.1 else 'outside'} 10%)")
    print(f"{'':>23}(largest layer, gathered while it runs: {estimate['largest_layer'] / 2**20:.1f} MiB in fp32; "
          f"model {states['total_params']:,} parameters)")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per side (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="1: one process; 2: deepspeed, ZeRO-3")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--quick", action="store_true", help="3 timed steps after 1 (development; noisy)")
    parser.add_argument("--hf-compiled", action="store_true",
                        help="also HF with each decoder layer compiled; the ratio is taken against the faster HF side")
    add_run_arguments(parser)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # for the workers and DeepSpeed's estimator here
    skipped = [dtype for dtype in args.dtypes if dtype not in peak.dtypes(device)]
    if skipped:
        print(f"{', '.join(skipped)}: not run, {SLOW_BF16}, both sides alike")
        args.dtypes = [dtype for dtype in args.dtypes if dtype not in skipped]
        if not args.dtypes:
            sys.exit("nothing to run: ask for --dtypes fp32")
    start = time.perf_counter()
    before = peak.measure(seconds=1.0, device=device)
    rows = [((ranks, dtype), run_pair(ranks, dtype, args)) for ranks in args.ranks for dtype in args.dtypes]
    after = peak.measure(seconds=1.0, device=device)
    # A peak measured while the machine was busy would flatter the MFU: keep the better one.
    peaks = {key: max(before[key], after[key]) if before[key] else None for key in ("peak_fp32", "peak_bf16")}
    peaks["device"] = device
    where = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(f"{where}; model: width {args.dim}, {args.layers} layers, {args.heads} heads, FFN {args.ffn}, vocab {VOCAB}, "
          f"seq {args.seq}, micro-batch {args.batch}/rank{', metaseq_ds layers compiled' if args.compile_layers else ''}; "
          f"ZeRO stage {'default' if args.zero_stage is None else args.zero_stage}; AdamW: metaseq_ds --adam-impl {args.adam_impl}, "
          f"HF torch.optim.AdamW; median of {args.steps} steps "
          f"after {args.warmup}, sides alternating")
    verdicts = print_throughput(rows, peaks, args)
    verdicts += print_memory(rows)
    print(f"summary ({time.perf_counter() - start:.0f} s): metaseq_ds/HF tokens/s " + "; ".join(verdicts))


if __name__ == "__main__":
    main()
