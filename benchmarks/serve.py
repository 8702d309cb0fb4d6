"""`mseq serve` under load: 64 concurrent requests vs the same requests one at a time.

    python benchmarks/serve.py [--requests 64] [--new-tokens 32] [--layers 4 --dim 256 --heads 4]

Writes a checkpoint of random weights (OPT-style, the byte tokenizer padded to OPT's 50272 ids,
like `benchmarks/generate.py`'s default model), starts `mseq serve` on it on 127.0.0.1 (a free
port; nothing leaves the machine) and sends greedy completions through the `openai` client:
first one at a time, then all at once. Every request asks for exactly `--new-tokens` tokens
(`min_tokens` = `max_tokens`), from a prompt of about 32 tokens. Prints, per phase, new tokens/s,
p50/p99 latency and how many requests failed or came back short, then the throughput ratio.
Target (issue 16): concurrent >= 3x one at a time, none lost or failed. Bounded: every request
has a time limit and the server is stopped at the end.
"""

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

REQUEST_TIMEOUT_S = 600
WORDS = "the server batches requests that arrive together into one decoding step for all".split()


def write_checkpoint(save_dir: Path, layers: int, dim: int, heads: int) -> None:
    import torch

    from metaseq_ds.checkpoint.files import write_module_checkpoint
    from metaseq_ds.data import Dictionary
    from metaseq_ds.models.transformer_lm import TransformerLanguageModel
    from metaseq_ds.options import parse_train_config

    cfg = parse_train_config([
        "--arch", "transformer_lm", "--decoder-layers", str(layers), "--decoder-embed-dim", str(dim),
        "--decoder-ffn-embed-dim", str(4 * dim), "--decoder-attention-heads", str(heads), "--decoder-learned-pos",
        "--decoder-normalize-before", "--share-decoder-input-output-embed", "--no-scale-embedding",
        "--tokens-per-sample", "512", "--final-vocab-size", "50272",
    ])
    torch.manual_seed(0)
    model = TransformerLanguageModel.build_model(cfg.model, SimpleNamespace(dictionary=Dictionary.of_size(50272)))
    write_module_checkpoint(save_dir, "checkpoint_1_0", model.state_dict(), {"config": cfg.to_dict()})


def start_server(checkpoint: Path, max_batch_tokens: int, stderr=subprocess.DEVNULL):
    """`mseq serve` on 127.0.0.1 (any free port) in its own process group; (process, base URL).
    `stderr`: where the server's goes (an open file keeps it for a report)."""
    command = [sys.executable, "-m", "metaseq_ds.cli.main", "serve", "--path", str(checkpoint), "--host", "127.0.0.1",
               "--port", "0", "--max-batch-tokens", str(max_batch_tokens)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    for line in server.stdout:
        if line.startswith("mseq serve: "):
            # Keep reading its access log, or a full pipe would block the server.
            threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
            return server, line.split(" on ", 1)[1].split()[0]
    server.wait()
    raise ServerDidNotStart(f"mseq serve exited ({server.returncode}) before printing its address")


class ServerDidNotStart(RuntimeError):
    pass


def stop_server(server: subprocess.Popen) -> None:
    """Ctrl-C to its process group (it finishes the batch it decodes), then a kill after 60 s."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def prompt(index: int) -> str:
    """About 32 byte tokens, different for each request."""
    words = [WORDS[(index * 7 + k) % len(WORDS)] for k in range(6)]
    return " ".join(words)[:31]


def timed_request(client, index: int, new_tokens: int):
    """(latency in s, completion tokens, error or None) of one greedy completion."""
    start = time.perf_counter()
    try:
        response = client.completions.create(model="bench", prompt=prompt(index), max_tokens=new_tokens,
                                             temperature=0, extra_body={"min_tokens": new_tokens})
    except Exception as error:  # counted and reported: the benchmark's point is that none fail
        return time.perf_counter() - start, 0, f"{type(error).__name__}: {error}"
    return time.perf_counter() - start, response.usage.completion_tokens, None


def run_phase(client, requests: int, new_tokens: int, concurrent: bool):
    start = time.perf_counter()
    if concurrent:
        with ThreadPoolExecutor(max_workers=requests) as pool:
            outcomes = list(pool.map(lambda i: timed_request(client, i, new_tokens), range(requests)))
    else:
        outcomes = [timed_request(client, i, new_tokens) for i in range(requests)]
    wall = time.perf_counter() - start
    latencies = sorted(latency for latency, _, _ in outcomes)
    tokens = sum(count for _, count, _ in outcomes)
    errors = [error for _, _, error in outcomes if error]
    short = sum(1 for _, count, error in outcomes if not error and count != new_tokens)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return SimpleNamespace(wall=wall, tokens=tokens, rate=tokens / wall, p50=statistics.median(latencies), p99=p99,
                           failed=len(errors), short=short, first_error=errors[0] if errors else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64, choices=range(1, 1025), metavar="1..1024")
    parser.add_argument("--new-tokens", type=int, default=32, choices=range(1, 449), metavar="1..448")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    import openai

    workdir = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    write_checkpoint(workdir / "ckpt", args.layers, args.dim, args.heads)
    budget = args.requests * (32 + args.new_tokens)  # every request in one batch
    try:
        server, url = start_server(workdir / "ckpt", max_batch_tokens=budget)
    except ServerDidNotStart as error:
        sys.exit(str(error))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        timed_request(client, 0, args.new_tokens)  # warm-up: first-call allocations
        print(f"model: {args.layers} layers, width {args.dim}, vocab 50272, fp32 CPU ({os.cpu_count()} cores); "
              f"{args.requests} greedy requests, prompts ~32 tokens, {args.new_tokens} new tokens each; "
              f"--max-batch-tokens {budget}")
        print(f"{'phase':>12} {'wall s':>7} {'new tok/s':>10} {'p50 s':>7} {'p99 s':>7} {'failed':>6} {'short':>5}")
        phases = {}
        for name, concurrent in (("one by one", False), ("concurrent", True)):
            phase = phases[name] = run_phase(client, args.requests, args.new_tokens, concurrent)
            print(f"{name:>12} {phase.wall:>7.1f} {phase.rate:>10.1f} {phase.p50:>7.2f} {phase.p99:>7.2f} "
                  f"{phase.failed:>6} {phase.short:>5}", flush=True)
            if phase.first_error:
                print(f"  first error: {phase.first_error}")
        ratio = phases["concurrent"].rate / phases["one by one"].rate
        lost = sum(p.failed + p.short for p in phases.values())
        verdict = "meets" if ratio >= 3 and not lost else "misses"
        print(f"summary: concurrent/one-by-one throughput {ratio:.1f}x, {lost} requests failed or short "
              f"({verdict} the target: >= 3x, none lost)")
    finally:
        stop_server(server)
        shutil.rmtree(workdir)


if __name__ == "__main__":
    main()
