"""Run `mseq train` as real processes (alone, under deepspeed, under torchrun) and read its logs.

The processes inherit the test's own working directory and HOME (tests/conftest.py), so the
relative defaults (`--save-dir checkpoints`, the demo's `data/demo_corpus`) land in the test's
temporary directory.
"""

import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

TINY = [
    "--arch", "transformer_lm_gpt2_tiny", "--tokens-per-sample", "32", "--log-format", "json",
    "--log-interval", "1", "--lr", "0.003", "--warmup-updates", "2", "--progress-bar", "none",
]

WORDS = ("the model reads tokens and predicts the next one while the optimizer updates "
         "weights shards ranks gradients data loss perplexity batch layer attention").split()


def write_corpus(root: Path, shards: int = 1, docs: int = 120, seed: int = 0) -> Path:
    """A small metaseq-layout corpus: train/00.., valid/00, one JSON document per line."""
    rng = random.Random(seed)
    for split, count, n_shards in (("train", docs, shards), ("valid", docs // 4, 1)):
        for shard in range(n_shards):
            folder = root / split / f"{shard:02d}"
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / "part.jsonl", "w") as out:
                for _ in range(count // n_shards):
                    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))
                    out.write(json.dumps({"text": text}) + "\n")
    return root


def tree_digest(folder: Path) -> str:
    """One hash of every path and file content under `folder`: equal digests, untouched folder."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode() + (path.read_bytes() if path.is_file() else b"/"))
    return digest.hexdigest()


def tiny_zero_engine(zero: dict, gradient_clipping: float = 1.0, bf16: bool = False, fused: bool = False):
    """A DeepSpeed engine on one rank (in a child process: it joins a process group) over a tiny
    MLP (16 -> 64 -> 4, 1348 parameters, seeded) with AdamW (`fused`: torch's fused kernel), under
    the `zero` section given."""
    import deepspeed
    import torch

    from metaseq_ds.distributed import utils as dist_utils

    dist_utils.init_distributed()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "gradient_clipping": gradient_clipping, "bf16": {"enabled": bf16}}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def tiny_zero_step(engine, step: int) -> float:
    """One update of `tiny_zero_engine` on a seeded regression batch; its loss."""
    import torch

    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
    dtype = engine.module[0].weight.dtype  # both operands: torch 2.11's mse_loss backward fails on bf16 vs fp32
    loss = torch.nn.functional.mse_loss(engine(x.to(dtype)), y.to(dtype))
    engine.backward(loss)
    engine.step()
    return loss.item()


def env() -> Dict[str, str]:
    out = dict(os.environ)
    out.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return out


def shm_leftovers(port: int) -> List[str]:
    """What a launch on `port` left in /dev/shm: DeepSpeed's CPU all-reduce buffers (~66 MB a rank)
    carry the port in their names, and metaseq_ds removes them, so this must be empty."""
    return sorted(path.name for path in Path("/dev/shm").iterdir() if f"_{port}_" in path.name)


def free_port() -> int:
    """A port no one listens on now, for a launch's rendezvous: a fixed one would make two test
    runs on one machine (or a launch left behind) collide."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_worker(worker: Path, prefix: str, ranks: int = 2) -> dict:
    """Run the script `worker` on `ranks` ranks under the deepspeed launcher; the JSON that its
    line starting with `prefix` and a space carries. Fails on leftovers in /dev/shm."""
    port = free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(port), str(worker)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=300)
    assert not shm_leftovers(port)
    lines = [line for line in result.stdout.splitlines() if line.startswith(prefix + " ")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def run(args: List[str], launcher: Optional[str] = None, timeout: int = 300, check: bool = True,
        ranks: int = 2, port: Optional[int] = None) -> subprocess.CompletedProcess:
    port = port or free_port()
    if launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port",
               str(port), "--module", "metaseq_ds.cli.train", *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(port), "-m", "metaseq_ds.cli.train", *args]
    else:
        cmd = [sys.executable, "-m", "metaseq_ds.cli.main", "train", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout)
    if launcher and shm_leftovers(port):  # every launch of the suite checks that none leaks
        raise AssertionError(f"{cmd} left {shm_leftovers(port)} in /dev/shm")
    if check and "train_inner" not in result.stdout:
        raise AssertionError(f"{cmd} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result


def log_records(stdout: str, tag: str = "train_inner") -> List[dict]:
    """metaseq's JSON log lines with the given tag, in order (rank 0 only logs)."""
    marker = f"| {tag} | "
    return [json.loads(line.split(marker, 1)[1]) for line in stdout.splitlines() if marker in line]


def losses(stdout: str) -> Dict[int, float]:
    return {r["num_updates"]: r["loss"] for r in log_records(stdout)}
