"""`mseq serve` under load: continuous batching vs static batching vs one request at a time.

    python benchmarks/serve.py [--clients 16] [--requests 64] [--rate 64] [--modes continuous,static,one]
                               [--max-batch-tokens 4096] [--max-model-len 256] [--layers 4 --dim 256 --heads 4]
                               [--compile | --no-compile]

Writes a checkpoint of random weights (OPT-style, the byte tokenizer padded to OPT's 50272 ids,
like `benchmarks/generate.py`'s default model), then starts `mseq serve` on it on 127.0.0.1 (a
free port; nothing leaves the machine) once per mode, one after another, each with the same
`--max-batch-tokens` and `--max-model-len` (continuous: slots = budget // positions per sequence,
16 by default; static: batches of at most the same budget; one: a request at a time).

Load: `--clients` concurrent clients, each a loop: think for an exponential time (a Poisson
process of `--rate` / `--clients` requests/s per client, `--rate` in all), then send one greedy
streaming completion (plain HTTP, server-sent events) and read it to its end. A client waits for
its answer before it thinks again, so at most `--clients` requests are in flight; the default
rate keeps the servers busy. Requests are token-id prompts of 8..128 tokens with max_tokens of
16..128 (`min_tokens` = `max_tokens`, so every answer's length is known), drawn from a fixed seed:
every mode sees the same requests, by the same clients, after the same think times. `--requests`
in all per mode, after one warm-up request.

Per mode: completed / failed requests (failed: an HTTP error, an error event, a time-out or an
answer that ended early), requests/s and output tokens/s (completion tokens / the wall time from
the first send to the last completion), TTFT (send -> first chunk with text), TPOT ((e2e - TTFT) /
(tokens - 1)) and e2e latency, p50 and p99. Then continuous/static: output tokens/s and p99 TTFT
against the targets of issue 28 (at 16 clients: >= 2x static's tokens/s, <= 0.5x static's p99
TTFT), PASS or MISS.

The limit: a decoding step of B sequences costs about what a step of one costs while decoding
is bound by reading the weights (a GPU, the model's weights much larger than its activations),
so B sequences can at best come out at B / (batch-1 step time) tokens/s, B = min(clients, slots).
The batch-1 step time is measured on the `one` server (else the static one): the TPOT p50 of
lone requests (8 prompt tokens, 128 new) sent after the load. On a 2-core CPU a step is bound
by arithmetic instead (and, for this small model, by the per-operation overhead of eager
PyTorch), a batch-B step costs several batch-1 steps, and the real limit is lower: the
continuous server's TPOT p50 under load (its step over the busy slots, with the prefills between
steps) gives the CPU limit B / (that step time), printed beside it.

Bounded: every request has a time limit (`REQUEST_TIMEOUT_S`, on the client and as the server's
`--request-timeout`), each server is stopped after its mode (killed when Ctrl-C does not stop
it), also on an error, and the checkpoint is deleted at the end.
"""

import argparse
import http.client
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional
from urllib.parse import urlsplit

REQUEST_TIMEOUT_S = 300
MODES = ("continuous", "static", "one")
SEED = 0
PROMPT_TOKENS, NEW_TOKENS = (8, 128), (16, 128)  # uniform, inclusive
PROBE_PROMPT, PROBE_NEW, PROBES = 8, 128, 3  # the lone requests that time one step
BYTE_ID = 4  # the byte tokenizer's id of byte 0 (0-3: the dictionary's specials)
WORDS = ("the server batches requests that arrive together into one decoding step for all of them while "
         "others wait in a queue until a slot is free").split()
TARGET_TOKENS, TARGET_TTFT = 2.0, 0.5  # continuous/static, issue 28


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


def start_server(checkpoint: Path, max_batch_tokens: int, stderr=subprocess.DEVNULL, extra_args=()):
    """`mseq serve` on 127.0.0.1 (any free port) in its own process group; (process, base URL).
    `stderr`: where the server's goes (an open file keeps it for a report); `extra_args`: more flags."""
    command = [sys.executable, "-m", "metaseq_ds.cli.main", "serve", "--path", str(checkpoint), "--host", "127.0.0.1",
               "--port", "0", "--max-batch-tokens", str(max_batch_tokens), *extra_args]
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
        server.wait()


def plan(requests: int, clients: int, rate: float, seed: int = SEED) -> List[List[SimpleNamespace]]:
    """Per client, its requests in order: think time (s), prompt (token ids), max_tokens."""
    rng = random.Random(seed)
    schedule: List[List[SimpleNamespace]] = [[] for _ in range(clients)]
    for index in range(requests):
        prompt = words(rng, rng.randint(*PROMPT_TOKENS))
        schedule[index % clients].append(SimpleNamespace(
            think=rng.expovariate(rate / clients), prompt=prompt, max_tokens=rng.randint(*NEW_TOKENS)))
    return schedule


def words(rng: random.Random, length: int) -> List[int]:
    """`length` token ids of random words: ASCII bytes as the byte tokenizer numbers them (a random
    model continues those with bytes too, so its answers stream text from the first token; ids
    past the bytes would decode to nothing and hold the text back to the end)."""
    text = " ".join(rng.choice(WORDS) for _ in range(length))
    return [BYTE_ID + b for b in text.encode("ascii")[:length]]


def stream_completion(url: str, prompt: List[int], max_tokens: int) -> SimpleNamespace:
    """One greedy streamed completion of exactly `max_tokens` tokens: its send, first-text and
    end times (perf_counter), and an error (None when it came back whole)."""
    address = urlsplit(url)
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                       "temperature": 0, "stream": True})
    out = SimpleNamespace(sent=time.perf_counter(), first=None, end=None, tokens=max_tokens, error=None, late=False)
    deadline = out.sent + REQUEST_TIMEOUT_S
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            out.error = f"HTTP {response.status}: {response.read()[:300].decode(errors='replace')}"
            return out
        finish = None
        for line in response:
            if time.perf_counter() > deadline:
                out.error = f"no end after {REQUEST_TIMEOUT_S} s"
                return out
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                out.error = f"error event: {event['error']}"
                return out
            choice = event["choices"][0]
            if choice["text"] and out.first is None:
                out.first = time.perf_counter()
            finish = choice["finish_reason"] or finish
        out.end = time.perf_counter()
        if finish != "length":
            out.error = f"finished with {finish!r}, not after {max_tokens} tokens"
        elif out.first is None:
            out.first, out.late = out.end, True  # no text before the end: TTFT is the e2e latency
    except Exception as error:  # counted and reported: the benchmark's point is that none fail
        out.error = f"{type(error).__name__}: {error}"
    finally:
        connection.close()
    return out


def run_load(url: str, schedule: List[List[SimpleNamespace]]) -> List[SimpleNamespace]:
    """Every client's loop (think, send, read to the end) in its own thread; all outcomes."""
    outcomes: List[SimpleNamespace] = []
    lock = threading.Lock()

    def client(items: List[SimpleNamespace]) -> None:
        for item in items:
            time.sleep(item.think)
            outcome = stream_completion(url, item.prompt, item.max_tokens)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(items,), daemon=True) for items in schedule]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def summarize(outcomes: List[SimpleNamespace]) -> SimpleNamespace:
    done = [o for o in outcomes if o.error is None]
    errors = [o.error for o in outcomes if o.error is not None]
    wall = (max(o.end for o in done) - min(o.sent for o in outcomes)) if done else float("nan")
    ttft = [o.first - o.sent for o in done]
    tpot = [(o.end - o.first) / (o.tokens - 1) for o in done if o.tokens > 1 and not o.late]
    e2e = [o.end - o.sent for o in done]
    return SimpleNamespace(
        completed=len(done), failed=len(errors), late=sum(o.late for o in done), first_error=errors[0] if errors else None, wall=wall,
        req_rate=len(done) / wall, tok_rate=sum(o.tokens for o in done) / wall,
        ttft50=percentile(ttft, 0.5), ttft99=percentile(ttft, 0.99), tpot50=percentile(tpot, 0.5),
        tpot99=percentile(tpot, 0.99), e2e50=percentile(e2e, 0.5), e2e99=percentile(e2e, 0.99))


def probe_step(url: str) -> Optional[float]:
    """The TPOT p50 of lone requests (one at a time): a step's time with nothing else decoding."""
    outcomes = [stream_completion(url, words(random.Random(SEED), PROBE_PROMPT), PROBE_NEW)
                for _ in range(PROBES)]
    tpots = [(o.end - o.first) / (o.tokens - 1) for o in outcomes if o.error is None and not o.late]
    return statistics.median(tpots) if tpots else None


def continuous_slots(max_batch_tokens: int, max_model_len: int, compiled: bool) -> int:
    """The continuous server's slots, as `ContinuousBatcher` counts them (compiled: capacity a power of two
    of at least 64 positions, slots a power of two, down)."""
    capacity = max(1 << (max_model_len - 1).bit_length(), 64) if compiled else max_model_len
    slots = max(1, max_batch_tokens // capacity)
    return 1 << (slots.bit_length() - 1) if compiled else slots


def run_mode(mode: str, checkpoint: Path, args, schedule, log) -> SimpleNamespace:
    """Start the mode's server, warm it up, run the load and the lone-request probe, stop it."""
    flags = ["--batching", mode, "--max-model-len", str(args.max_model_len),
             "--request-timeout", str(REQUEST_TIMEOUT_S)]
    if args.compile is not None:
        flags.append("--compile" if args.compile else "--no-compile")
    log.write(f"==== mseq serve --batching {mode}\n")
    log.flush()
    server, url = start_server(checkpoint, args.max_batch_tokens, stderr=log, extra_args=flags)
    try:
        warm = stream_completion(url, words(random.Random(SEED), 16), 16)  # first-call allocations
        if warm.error:
            print(f"  {mode}: warm-up request failed: {warm.error}", flush=True)
        result = summarize(run_load(url, schedule))
        result.step = probe_step(url) if mode != "continuous" else None
        return result
    finally:
        stop_server(server)
        log.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16, choices=range(1, 257), metavar="1..256")
    parser.add_argument("--requests", type=int, default=64, choices=range(1, 4097), metavar="1..4096")
    parser.add_argument("--rate", type=float, default=64.0, help="requests/s offered, all clients together")
    parser.add_argument("--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES))
    parser.add_argument("--max-batch-tokens", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="passed to mseq serve (default: the server's, on CUDA only)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: a comma list of {', '.join(MODES)}")
    if args.rate <= 0:
        parser.error("--rate: requests/s, above 0")
    if args.max_model_len < PROMPT_TOKENS[1] + NEW_TOKENS[1]:
        parser.error(f"--max-model-len: at least {PROMPT_TOKENS[1] + NEW_TOKENS[1]} (the longest prompt and answer)")
    if args.max_batch_tokens < args.max_model_len:
        parser.error("--max-batch-tokens: at least --max-model-len (one sequence)")

    import torch

    compiled = args.compile if args.compile is not None else torch.cuda.is_available()
    slots = continuous_slots(args.max_batch_tokens, args.max_model_len, compiled)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    schedule = plan(args.requests, args.clients, args.rate)
    items = [item for items in schedule for item in items]
    print(f"model: {args.layers} layers, width {args.dim}, vocab 50272, random weights, {device}; "
          f"--max-batch-tokens {args.max_batch_tokens} --max-model-len {args.max_model_len} "
          f"(continuous: {slots} slots), compile {'on' if compiled else 'off'}")
    print(f"load: {args.clients} clients, {args.rate:g} requests/s offered (Poisson), {args.requests} greedy streamed "
          f"requests per mode, prompts {PROMPT_TOKENS[0]}..{PROMPT_TOKENS[1]} tokens "
          f"(mean {statistics.mean(len(i.prompt) for i in items):.0f}), {NEW_TOKENS[0]}..{NEW_TOKENS[1]} new "
          f"(mean {statistics.mean(i.max_tokens for i in items):.0f}, {sum(i.max_tokens for i in items)} in all)",
          flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    results = {}
    try:
        write_checkpoint(workdir / "ckpt", args.layers, args.dim, args.heads)
        print(f"{'mode':>10} {'done':>5} {'failed':>6} {'wall s':>7} {'req/s':>6} {'out tok/s':>9} "
              f"{'TTFT p50':>8} {'p99':>6} {'TPOT p50':>8} {'p99':>6} {'e2e p50':>7} {'p99':>6}  (s)", flush=True)
        with open(workdir / "server.log", "w") as log:
            for mode in modes:
                try:
                    r = results[mode] = run_mode(mode, workdir / "ckpt", args, schedule, log)
                except ServerDidNotStart as error:
                    log.flush()
                    print(f"{mode:>10} {error}; its stderr:\n{(workdir / 'server.log').read_text(errors='replace')}")
                    sys.exit(1)
                print(f"{mode:>10} {r.completed:>5} {r.failed:>6} {r.wall:>7.1f} {r.req_rate:>6.2f} {r.tok_rate:>9.1f} "
                      f"{r.ttft50:>8.3f} {r.ttft99:>6.3f} {r.tpot50:>8.4f} {r.tpot99:>6.4f} {r.e2e50:>7.2f} "
                      f"{r.e2e99:>6.2f}", flush=True)
                if r.first_error:
                    print(f"{'':>10} first error: {r.first_error}", flush=True)
                if r.late:
                    print(f"{'':>10} {r.late} answers streamed no text before their end (TTFT = e2e there)")
        server_log = (workdir / "server.log").read_text(errors="replace")
        report(args, slots, results)
        trouble = [line for line in server_log.splitlines() if "ERROR" in line or "Traceback" in line]
        if trouble or any(r.failed for r in results.values()):
            print("server stderr (errors):\n" + "\n".join(trouble[:40]))
    finally:
        shutil.rmtree(workdir)


def report(args, slots: int, results) -> None:
    if "continuous" in results and "static" in results:
        c, s = results["continuous"], results["static"]
        tokens, ttft = c.tok_rate / s.tok_rate, c.ttft99 / s.ttft99
        print(f"continuous/static: output tok/s {tokens:.2f}x (target >= {TARGET_TOKENS:g}x: "
              f"{'PASS' if tokens >= TARGET_TOKENS else 'MISS'}), p99 TTFT {ttft:.2f}x (target <= {TARGET_TTFT:g}x: "
              f"{'PASS' if ttft <= TARGET_TTFT else 'MISS'}); targets for {args.clients} clients as issue 28 sets "
              f"them at 16")
    batch = min(args.clients, slots)
    step1 = next((results[m].step for m in ("one", "static") if m in results and results[m].step), None)
    if step1 is None:
        print("limit: needs the one or static mode (the batch-1 step time)")
        return
    limit = batch / step1
    line = f"limit at B={batch} sequences = B / batch-1 step ({step1 * 1e3:.1f} ms) = {limit:.1f} tokens/s"
    if "continuous" in results:
        c = results["continuous"]
        line += f"; continuous reaches {c.tok_rate:.1f} = {c.tok_rate / limit:.0%} of it"
        print(line)
        print(f"under load the continuous step (with its prefills) took {c.tpot50 * 1e3:.1f} ms (TPOT p50) = "
              f"{c.tpot50 / step1:.1f}x the batch-1 step; at that step B sequences come out at "
              f"{batch / c.tpot50:.1f} tokens/s, continuous reaches {c.tok_rate / (batch / c.tpot50):.0%} of it")
    else:
        print(line)


if __name__ == "__main__":
    main()
