"""Peak memory of `mseq reshard` on a 4-rank tensor-parallel 2 x ZeRO-3 checkpoint, to 1 rank.

    python -m benchmarks.reshard [--layers 8] [--width 1024] [--workdir DIR]

Trains a ~100M-parameter model (byte vocabulary, width 1024, 8 layers, FFN 4096) for one update
under `deepspeed --num_gpus 4` with `--model-parallel-size 2 --zero-stage 3` and saves it, then
runs `mseq reshard CKPT OUT --ranks 1` in a fresh process and prints that process's peak RSS next
to the theory: one consolidated copy of the parameters' training state, 12 bytes a parameter
(fp32 master weights 4 + Adam's two moments 8). Target (issue 14): peak <= 1.5x theory. The
"base" line is the peak of a process that only imports what `mseq reshard` imports (Python,
torch, DeepSpeed), included in the peak.
"""

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.export_memory import run_measured

GIB = 2**30


def write_corpus(root: Path) -> None:
    rng = random.Random(0)
    words = "the model reads tokens and predicts the next one while ranks share the optimizer state".split()
    for split, docs in (("train", 200), ("valid", 20)):
        (root / split / "00").mkdir(parents=True)
        with open(root / split / "00" / "part.jsonl", "w") as out:
            for _ in range(docs):
                out.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))}) + "\n")


def safetensors_numel(path: Path) -> int:
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            numel = 1
            for size in entry["shape"]:
                numel *= size
            total += numel
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--workdir", help="where the checkpoints go (default: a temp dir, removed)")
    args = parser.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="reshard_memory_"))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        write_corpus(workdir / "corpus")
        save_dir = workdir / "tp2_dp2_zero3"
        start = time.perf_counter()
        train = subprocess.run(
            [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "4", "--master_port",
             str(29500 + os.getpid() % 500), "--module", "metaseq_ds.cli.train", str(workdir / "corpus"),
             "--arch", "transformer_lm_gpt2_tiny", "--decoder-embed-dim", str(args.width),
             "--decoder-ffn-embed-dim", str(4 * args.width), "--decoder-layers", str(args.layers),
             "--decoder-attention-heads", "16", "--tokens-per-sample", "32", "--batch-size", "1", "--max-update", "1",
             "--model-parallel-size", "2", "--zero-stage", "3", "--disable-validation", "--progress-bar", "none",
             "--save-dir", str(save_dir)],
            capture_output=True, text=True, env=env, timeout=3600)
        if not (save_dir / "checkpoint_last").is_file():
            sys.exit(f"training failed:\n{train.stdout[-3000:]}\n{train.stderr[-3000:]}")
        print(f"checkpoint: 4 ranks = 2 data-parallel x 2 tensor-parallel, ZeRO-3, fp32 "
              f"(trained and saved in {time.perf_counter() - start:.0f} s)")

        code, out, base = run_measured([sys.executable, "-c", "import torch, deepspeed, metaseq_ds.checkpoint.reshard"])
        if code != 0:
            sys.exit(f"import failed:\n{out[-3000:]}")
        start = time.perf_counter()
        code, out, peak = run_measured([sys.executable, "-m", "metaseq_ds.cli.main", "reshard", str(save_dir),
                                        str(workdir / "one_rank"), "--ranks", "1"])
        seconds = time.perf_counter() - start
        if code != 0:
            sys.exit(f"reshard failed:\n{out[-3000:]}")
        tag = (save_dir / "checkpoint_last").read_text().strip()
        parameters = safetensors_numel(workdir / "one_rank" / tag / "fp32.safetensors")
        theory = 12 * parameters
        print(f"model: {parameters / 1e6:.1f}M parameters (width {args.width}, {args.layers} layers, FFN {4 * args.width})")
        print(f"theory: one consolidated copy of fp32 weights + Adam's two moments = 12 B x {parameters / 1e6:.1f}M "
              f"= {theory / GIB:.3f} GiB")
        print(f"mseq reshard -> 1 rank: {seconds:.1f} s, peak RSS {peak / GIB:.3f} GiB = {peak / theory:.2f}x theory "
              f"(target <= 1.5x); base (imports alone) {base / GIB:.3f} GiB")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
