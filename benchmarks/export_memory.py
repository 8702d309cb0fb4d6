"""Peak memory of `mseq export hf` on a ~350M-parameter model (OPT-350m's shape, random weights).

    python -m benchmarks.export_memory [--arch opt_350m] [--dtype fp32] [--workdir DIR]

Writes a ZeRO-0 checkpoint of `--arch` (random weights, the byte tokenizer padded to OPT's
50272 ids, 2048 positions), runs `mseq export hf` on it in a fresh process and prints that
process's peak resident memory next to the model's size in bytes. Target (issue 4): peak
under 1.5x the model's fp32 size, i.e. never two copies of the model in memory.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.peak_memory import peak_rss


def write_checkpoint(save_dir: Path, arch: str) -> int:
    """The checkpoint `mseq train` would save after 0 updates; returns the model's fp32 bytes."""
    import torch

    from metaseq_ds.checkpoint.files import write_module_checkpoint
    from metaseq_ds.data import Dictionary
    from metaseq_ds.models.transformer_lm import TransformerLanguageModel
    from metaseq_ds.options import parse_train_config

    cfg = parse_train_config(["--arch", arch, "--tokens-per-sample", "2048", "--final-vocab-size", "50272"])
    torch.manual_seed(0)
    model = TransformerLanguageModel.build_model(cfg.model, SimpleNamespace(dictionary=Dictionary.of_size(50272)))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    write_module_checkpoint(save_dir, "checkpoint_1_0", model.state_dict(), {"config": cfg.to_dict()})
    return model_bytes


def run_measured(cmd):
    """(exit code, output, peak RSS in bytes) of one child process (its own rusage, via wait4)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        return proc.returncode, log.read(), peak_rss(usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="opt_350m")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--workdir", help="where the checkpoint and export go (default: a temp dir, removed)")
    args = parser.parse_args()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="export_memory_"))
    try:
        start = time.perf_counter()
        code, out, writer_peak = run_measured([sys.executable, __file__, "--write-only", args.arch, str(workdir / "ckpt")])
        if code != 0:
            sys.exit(f"writing the checkpoint failed:\n{out[-3000:]}")
        model_bytes = int(out.strip().splitlines()[-1])
        print(f"checkpoint written in {time.perf_counter() - start:.1f} s (writer peak {writer_peak / 2**30:.2f} GiB)")
        start = time.perf_counter()
        code, out, peak = run_measured([sys.executable, "-m", "metaseq_ds.cli.main", "export", "hf",
                                        str(workdir / "ckpt"), str(workdir / "hf"), "--dtype", args.dtype])
        seconds = time.perf_counter() - start
        if code != 0:
            sys.exit(f"export failed:\n{out[-3000:]}")
        print(f"model: {args.arch}, {model_bytes / 4:,.0f} parameters, {model_bytes / 2**30:.3f} GiB in fp32")
        print(f"export --dtype {args.dtype}: {seconds:.1f} s, peak RSS {peak / 2**30:.3f} GiB "
              f"= {peak / model_bytes:.2f}x the model's fp32 size (target < 1.5x)")
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--write-only":
        print(write_checkpoint(Path(sys.argv[3]), sys.argv[2]))
    else:
        main()
