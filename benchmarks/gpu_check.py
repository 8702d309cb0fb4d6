"""Every user flow on a CUDA machine, then the GPU benchmarks (`benchmarks/gpu_check.sh` runs it).

    python -m benchmarks.gpu_check [--budget 345] [--benchmarks "train ZeRO-0,generate"] [--no-flows]
    python -m benchmarks.gpu_check --cpu-rehearsal      # the flows on the CPU, a short demo, no benchmarks

Each flow runs as the user's commands, in a scratch directory, and is PASS or FAIL (with the
tail of its output); the benchmarks print their own tables and summaries. Flows that do not
need the GPU to themselves run side by side, the benchmarks one at a time after them; a
benchmark that would start after `--budget` seconds is SKIPPED, one that would run past it is
CUT, so the check ends in time. The last line is the summary: one verdict per flow, one figure
line per benchmark. `--cpu-rehearsal` runs the same flows on a machine without CUDA (the demo
cut to 40 updates, too few to beat the entropy), to try the check itself before spending GPU
time on it. `--no-flows` runs the benchmarks alone: a second run, once the flows have passed,
gives its whole budget to the benchmarks the first one left out.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parent.parent
MSEQ = [sys.executable, "-m", "metaseq_ds.cli.main"]
OPT_1_3B = ["--layers", "24", "--dim", "2048", "--heads", "32"]
START = time.perf_counter()
DEVICE = "cuda"  # "cpu" in a --cpu-rehearsal
DEMO_FLAGS: List[str] = []  # the demo's own defaults; a rehearsal cuts its updates


class FlowFailed(Exception):
    pass


def elapsed() -> float:
    return time.perf_counter() - START


def run(name: str, command: List[str], cwd: Path, timeout: float, log_dir: Path) -> str:
    """Run `command`; its output (stdout and stderr) is kept in `log_dir/name.log` and returned.
    A non-zero exit or a timeout fails the flow with the output's tail."""
    log = log_dir / f"{name}.log"
    with open(log, "w") as out:
        try:
            process = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            returncode = f"timeout after {timeout:.0f} s"
    text = log.read_text(errors="replace")
    if returncode != 0:
        raise FlowFailed(f"{' '.join(command[2:6])}... exit {returncode}:\n{tail(text)}")
    return text


def tail(text: str, lines: int = 25) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def last_float(pattern: str, text: str) -> float:
    found = re.findall(pattern, text, re.MULTILINE)
    if not found:
        raise FlowFailed(f"no line matching {pattern!r}:\n{tail(text)}")
    return float(found[-1])


# -- the flows ---------------------------------------------------------------------------------

def demo(work: Path, logs: Path) -> str:
    """The README's main job, default flags: trains, validates, saves; the loss must beat the
    corpus's byte-unigram entropy (what CI checks on the CPU)."""
    text = run("demo", [*MSEQ, "train", *DEMO_FLAGS], work, 240, logs)
    loss = last_float(r"^valid: loss ([0-9.]+) bits/token", text)
    entropy = last_float(r"^byte-unigram entropy of the demo corpus: ([0-9.]+) bits/token", text)
    updates = [int(n) for n in re.findall(r'"num_updates": (\d+)', text)]
    if not loss < entropy and not DEMO_FLAGS:  # a rehearsal's few updates learn less
        raise FlowFailed(f"valid loss {loss} bits/token is not below the entropy {entropy}")
    relation = "<" if loss < entropy else ">="  # >= only in a rehearsal
    return f"{max(updates or [0])} updates, valid loss {loss:.3f} {relation} entropy {entropy:.3f} bits"


def validate(work: Path, logs: Path) -> str:
    text = run("validate", [*MSEQ, "validate", "--path", "checkpoints"], work, 120, logs)
    return f"valid loss {last_float(r'^valid: loss ([0-9.]+)', text):.3f} bits"


def generate(work: Path, logs: Path) -> str:
    text = run("generate", [*MSEQ, "generate", "--path", "checkpoints", "--max-tokens", "24", "--output-format", "jsonl",
                            "def main():"], work, 120, logs)
    results = [json.loads(line) for line in text.splitlines() if line.startswith('{"prompt"')]
    if len(results) != 1 or len(results[0]["tokens"]) != 24:
        raise FlowFailed(f"expected one completion of 24 tokens:\n{tail(text)}")
    fallback = re.search(r"compiling the decoding step failed.*", text)
    step = f"the step ran EAGERLY: {fallback.group(0)}" if fallback else "the compiled step (CUDA graph)"
    return f"24 tokens, finish_reason {results[0]['finish_reason']}, {step}"


def serve(work: Path, logs: Path) -> str:
    """`mseq serve` answering the official openai client, plain and streamed."""
    import openai

    from benchmarks.serve import ServerDidNotStart, start_server, stop_server

    with open(logs / "serve.log", "w") as log:
        try:
            server, url = start_server(work / "checkpoints", max_batch_tokens=4096, stderr=log)
        except ServerDidNotStart as error:
            raise FlowFailed(f"{error}:\n{tail((logs / 'serve.log').read_text(errors='replace'))}") from None
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        plain = client.completions.create(model="demo", prompt="import os\n", max_tokens=12, temperature=0,
                                          extra_body={"min_tokens": 12})
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(
            model="demo", prompt="import os\n", max_tokens=12, temperature=0, stream=True, extra_body={"min_tokens": 12}))
    finally:
        stop_server(server)
    if plain.usage.completion_tokens != 12 or plain.choices[0].text != streamed:
        raise FlowFailed(f"completion {plain.choices[0].text!r} ({plain.usage.completion_tokens} tokens), "
                         f"streamed {streamed!r}")
    return "12 tokens, plain = streamed"


def export(work: Path, logs: Path) -> str:
    """`mseq export hf`, loaded by transformers on the GPU: its logits equal ours (fp32)."""
    import torch
    from transformers import OPTForCausalLM

    from metaseq_ds.checkpoint.inference import load_model_for_inference

    run("export", [*MSEQ, "export", "hf", "checkpoints", "hf_export"], work, 120, logs)
    hf = OPTForCausalLM.from_pretrained(work / "hf_export").to(DEVICE).eval()
    _, _, ours, _ = load_model_for_inference(str(work / "checkpoints"), need_data=False)
    if next(ours.parameters()).device.type != DEVICE:
        raise FlowFailed(f"the checkpoint loaded on {next(ours.parameters()).device}, not {DEVICE}")
    tokens = torch.randint(4, 250, (2, 64), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        ours_logits = ours(tokens)[0].float()
        hf_logits = hf(tokens).logits.float()[..., : ours_logits.size(-1)]
    difference = (ours_logits - hf_logits).abs().max().item()
    if not difference < 1e-3:
        raise FlowFailed(f"logits differ by {difference:.2e}")
    return f"logits equal to {difference:.1e}"


def resume(work: Path, logs: Path) -> str:
    """The demo's command again with a larger --max-update: it continues from checkpoint_last. In a
    copy of the demo's folder, so that it runs beside the flows that read the demo's checkpoint."""
    folder = work / "resume"
    for name in ("checkpoints", "data"):
        shutil.copytree(work / name, folder / name, symlinks=True)
    before = int((folder / "checkpoints" / "checkpoint_last").read_text().strip().split("_")[-1])
    text = run("resume", [*MSEQ, "train", "--max-update", str(before + 20)], folder, 120, logs)
    updates = [int(n) for n in re.findall(r'"num_updates": (\d+)', text)]
    if not updates or min(updates) <= before or max(updates) != before + 20:
        raise FlowFailed(f"logged updates {updates[:3]}...{updates[-3:]}, expected {before + 1}..{before + 20}:\n{tail(text)}")
    return f"updates {before} -> {before + 20}"


def launcher(stage: int, gpus: int, work: Path, logs: Path) -> str:
    """A few demo updates under the deepspeed launcher, on every GPU; TP=2 when there are 2 or more."""
    folder = work / f"zero{stage}"
    folder.mkdir()
    tp = ["--model-parallel-size", "2"] if gpus >= 2 else []
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(gpus), "--master_port",
               str(29500 + stage), "--module", "metaseq_ds.cli.train", "--demo", "--zero-stage", str(stage),
               "--max-update", "8", "--log-interval", "4", "--max-valid-steps", "2", *tp]
    text = run(f"zero{stage}", command, folder, 180, logs)
    if (folder / "checkpoints" / "checkpoint_last").read_text().strip() != "checkpoint_1_8":
        raise FlowFailed(f"no checkpoint of update 8:\n{tail(text)}")
    return f"{gpus} rank(s){', TP=2' if tp else ''}, 8 updates saved"


# -- the benchmarks ------------------------------------------------------------------------------

BENCHMARKS = [  # (name, module, arguments, most seconds)
    # The compiled step compiles (and captures its CUDA graph) once per batch bucket: ~1 min in all.
    ("generate", "benchmarks.generate", ["--device", "cuda", "--dtype", "bf16", *OPT_1_3B,
                                         "--variants", "static compiled,incremental eager,HF,HF static"], 180),
    ("train ZeRO-0", "benchmarks.train", ["--ranks", "1", "--dtypes", "bf16", *OPT_1_3B, "--ffn", "8192", "--seq", "2048",
                                          "--batch", "8", "--steps", "4", "--warmup", "1"], 150),
    # ZeRO-0's bf16 optimizer step at that size, DeepSpeed's (a read of the device per parameter) and ours (~20 s).
    ("zero0 step", "benchmarks.zero0_step", ["--device", "cuda", "--dtype", "bf16", *OPT_1_3B, "--ffn", "8192"], 90),
    ("train ZeRO-3", "benchmarks.train", ["--ranks", "1", "--dtypes", "bf16", *OPT_1_3B, "--ffn", "8192", "--seq", "2048",
                                          "--batch", "8", "--steps", "4", "--warmup", "1", "--zero-stage", "3"], 150),
    # Whether a vocabulary padded to a multiple of 128, or the weight gradient cut at 64 rows, would
    # speed the projection and loss (~20 s).
    ("vocab padding", "benchmarks.vocab_padding", ["--device", "cuda", "--dtype", "bf16"], 60),
    # Where our step's time goes (issue 34's item 1): matmul, attention and other kernels, and the
    # GPU's idle time between kernels (host gaps), ZeRO-0 and ZeRO-3 on one rank (~40 s each).
    ("profile ZeRO-0", "benchmarks.profile_train", ["--dtype", "bf16", *OPT_1_3B, "--ffn", "8192", "--seq", "2048",
                                                    "--batch", "8", "--steps", "2"], 90),
    ("profile ZeRO-3", "benchmarks.profile_train", ["--dtype", "bf16", *OPT_1_3B, "--ffn", "8192", "--seq", "2048",
                                                    "--batch", "8", "--steps", "2", "--zero-stage", "3"], 90),
    # Both sides compiled layer by layer, and HF eager: the ratio is against the faster HF side.
    ("train compiled layers", "benchmarks.train", ["--ranks", "1", "--dtypes", "bf16", *OPT_1_3B, "--ffn", "8192",
                                                   "--seq", "2048", "--batch", "8", "--steps", "4", "--warmup", "2",
                                                   "--compile-layers", "--hf-compiled"], 240),
]


def benchmark(name: str, module: str, arguments: List[str], seconds: float, logs: Path) -> str:
    text = run(name.replace(" ", "_"), [sys.executable, "-m", module, *arguments], ROOT, seconds, logs)
    print(text, flush=True)
    summaries = re.findall(r"^summary.*$", text, re.MULTILINE)
    return summaries[-1] if summaries else "no summary line"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=345, help="seconds: no benchmark starts after this, and "
                        "none runs past it")
    parser.add_argument("--benchmarks", default=",".join(name for name, *_ in BENCHMARKS),
                        help="comma-separated, of: " + ", ".join(name for name, *_ in BENCHMARKS))
    parser.add_argument("--cpu-rehearsal", action="store_true", help="the flows on the CPU (40 demo updates), no benchmarks")
    parser.add_argument("--no-flows", action="store_true", help="the benchmarks only (a second run, once the flows passed)")
    args = parser.parse_args()
    import torch

    global DEVICE, DEMO_FLAGS
    if args.cpu_rehearsal:
        DEVICE, DEMO_FLAGS, args.budget = "cpu", ["--max-update", "40", "--validate-interval-updates", "20"], 0
        os.environ["DS_ACCELERATOR"] = "cpu"
    gpus = torch.cuda.device_count() or 1
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    logs = work / "logs"
    logs.mkdir()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (rehearsal)"
    print(f"gpu_check: {gpus} x {where}, torch {torch.__version__}, in {work}", flush=True)
    verdicts: Dict[str, str] = {}

    def attempt(name: str, flow: Callable[[], str]) -> bool:
        started = elapsed()
        try:
            detail = flow()
        except BaseException as error:  # a failed flow is reported, and the others still run
            verdicts[name] = "FAIL"
            print(f"FAIL {name} ({elapsed() - started:.0f} s): {type(error).__name__}: {error}", flush=True)
            return False
        verdicts[name] = "PASS"
        print(f"PASS {name} ({elapsed() - started:.0f} s): {detail}", flush=True)
        return True

    if not args.no_flows:
        with ThreadPoolExecutor(max_workers=8) as pool:
            launches = [pool.submit(attempt, f"zero{stage}", lambda stage=stage: launcher(stage, gpus, work, logs))
                        for stage in (1, 2, 3)]
            if attempt("demo", lambda: demo(work, logs)):
                after_demo = [pool.submit(attempt, name, lambda flow=flow: flow(work, logs))
                              for name, flow in (("validate", validate), ("generate", generate), ("serve", serve),
                                                 ("export hf", export), ("resume", resume))]
                for future in after_demo:
                    future.result()
            for future in launches:
                future.result()
    figures: List[str] = []
    chosen = [name.strip() for name in args.benchmarks.split(",") if name.strip()]
    for name, module, arguments, seconds in [entry for entry in BENCHMARKS if entry[0] in chosen]:
        left = args.budget - elapsed()
        if left < 30:
            figures.append(f"{name}: SKIPPED (budget)")
            continue
        started = elapsed()
        try:
            figures.append(f"{name}: {benchmark(name, module, arguments, min(seconds, left), logs)}")
        except FlowFailed as error:
            figures.append(f"{name}: {'CUT (budget)' if seconds > left and 'timeout' in str(error) else 'FAIL'}")
            print(f"FAIL {name} ({elapsed() - started:.0f} s): {error}", flush=True)
    shutil.rmtree(work / "hf_export", ignore_errors=True)
    flows = ", ".join(f"{name} {verdict}" for name, verdict in verdicts.items()) or "not run (--no-flows)"
    print(f"gpu_check summary ({elapsed():.0f} s, logs in {logs}): flows: {flows}; " + " | ".join(figures), flush=True)
    sys.exit(0 if all(v == "PASS" for v in verdicts.values()) else 1)


if __name__ == "__main__":
    main()
