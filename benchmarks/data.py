"""The data pipeline: token store build throughput, resume cost, and whether training waits on data.

    python -m benchmarks.data                   # all three parts, ~8-10 minutes on 2 cores
    python -m benchmarks.data --quick           # 24 MB corpus, iteration 5,000, 2 pairs of 20 updates (~3 min)
    python -m benchmarks.data --parts build,resume --corpus-mb 100 --workdir /tmp/data_bench

Everything runs on text generated here (pseudo-words drawn from a Zipf distribution, in
metaseq's jsonl layout) with a GPT-2-sized byte BPE trained here on it with Hugging Face
`tokenizers` (50,000 merges; given to `mseq` as --vocab-filename/--merges-filename):

(a) build: MB/s of jsonl and tokens/s of a token store build (`open_store`, as `mseq preprocess`
    and `mseq train` run it, each run with a freshly loaded tokenizer) with --workers 1 (in this
    process) and --workers 2 (processes of one thread each), against a single-threaded loop of
    `tokenizer.encode` over the same lines (JSON parsing included on all sides); `--repeats`
    runs of each, in turn, medians. Target: >= 1.8x on 2 cores. The generated text is ASCII,
    so every document takes the exact ASCII fast path of byte-level BPE
    (`metaseq_ds.data.bytelevel_ascii`); documents with other characters take the tokenizers
    library's batch encoding (on its Rust threads with --workers 1), about 1.7x the loop on 2 cores.
(b) resume: seconds from a fresh task to the first batch at iteration 0 and at iteration
    `--resume-iteration` of an epoch (batch 1, --tokens-per-sample 256), for the indexed path
    and for the path before the token store (the stream tokenized front to back and skipped,
    rebuilt below from `DocumentToSequenceDataset` + `rank_rows` + `collated_batches`).
    Target: the indexed path's two times differ by < 1 s; the old one grows linearly.
(c) train: `mseq train` on the whole corpus (>= 200 MB of jsonl by default) logs wps; the same
    model's `Trainer.train_step` on batches already in memory gives the train_step-only wps.
    Pairs of runs alternate (step-only then train, train then step-only, ...) so that load on a
    shared machine hits both alike; the ratio is the median over the pairs. Target: mseq train no
    more than 3% below train_step only (above it is noise between the two processes: the data
    path cannot make a step faster).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Dict, List

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ea")]
FILE_BYTES = 32 << 20
STEP_ONLY_MARKER = "| step_only | "


# ---- the corpus and the tokenizer ----------------------------------------------------------


def write_corpus(data: Path, megabytes: int, seed: int = 0) -> List[str]:
    """`megabytes` of train jsonl in files of 32 MB, plus a small valid split; returns the first
    20 MB of text (to train the BPE on). Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    count = 200_000
    shape = rng.integers(0, len(SYLLABLES), (count, 4))
    sizes = rng.integers(1, 5, count)
    words = np.array(["".join(SYLLABLES[s] for s in shape[i, : sizes[i]]) for i in range(count)], dtype=object)
    sample: List[str] = []
    sample_bytes = 0
    for split, budget, folder in (("train", megabytes << 20, data / "train" / "00"), ("valid", 1 << 20, data / "valid" / "00")):
        folder.mkdir(parents=True, exist_ok=True)
        written, part, out = 0, 0, None
        while written < budget:
            if out is None or out.tell() >= FILE_BYTES:
                if out:
                    out.close()
                out = open(folder / f"part-{part:03d}.jsonl", "w")
                part += 1
            text = " ".join(words[np.minimum(rng.zipf(1.2, int(rng.integers(20, 800))), count) - 1])
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            written += len(line)
            if split == "train" and sample_bytes < 20 << 20:
                sample.append(text)
                sample_bytes += len(text)
        out.close()
    return sample


def train_bpe(texts: List[str], folder: Path, merges: int):
    """A GPT-2-style byte BPE with `merges` merges and OPT's special ids 0-3."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=256 + 4 + merges, min_frequency=2, show_progress=False,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>"])
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges_file = bpe.save_model(str(folder))
    return vocab, merges_file


def prepare(workdir: Path, megabytes: int, merges: int):
    """The corpus and tokenizer under `workdir`, made once (a marker records what was made)."""
    marker = workdir / "made.json"
    made = {"corpus_mb": megabytes, "merges": merges}
    data, bpe = workdir / "corpus", workdir / "bpe"
    if not marker.exists() or json.loads(marker.read_text()) != made:
        shutil.rmtree(data, ignore_errors=True)
        started = time.perf_counter()
        sample = write_corpus(data, megabytes)
        print(f"generated {megabytes} MB of jsonl in {time.perf_counter() - started:.0f} s", flush=True)
        started = time.perf_counter()
        train_bpe(sample, bpe, merges)
        print(f"trained a byte BPE with {merges} merges in {time.perf_counter() - started:.0f} s", flush=True)
        marker.write_text(json.dumps(made))
    return data, bpe / "vocab.json", bpe / "merges.txt"


def tokenizer_flags(vocab: Path, merges: Path) -> List[str]:
    return ["--vocab-filename", str(vocab), "--merges-filename", str(merges)]


def make_task(data: Path, vocab: Path, merges: Path, **values):
    from metaseq_ds.dataclass import validate_config
    from metaseq_ds.tasks import setup_task
    from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig

    cfg = validate_config(StreamingLanguageModelingConfig,
                          {"data": str(data), "vocab_filename": str(vocab), "merges_filename": str(merges), **values})
    return setup_task(cfg)


# ---- (a) build throughput ------------------------------------------------------------------


def bench_build(data: Path, vocab: Path, merges: Path, megabytes: int, workdir: Path, workers: List[int], repeats: int) -> Dict:
    from metaseq_ds.data.jsonl_record import document_text
    from metaseq_ds.data.token_store import open_store

    shard = workdir / "build_corpus" / "train" / "00"  # the first files of the corpus, linked
    shutil.rmtree(shard.parent.parent, ignore_errors=True)
    shard.mkdir(parents=True)
    size = 0
    for path in sorted((data / "train" / "00").glob("*.jsonl")):
        if size >= megabytes << 20:
            break
        os.link(path, shard / path.name)
        size += path.stat().st_size
    task = make_task(shard.parent.parent, vocab, merges)
    tokenizer, eod = task.tokenizer, task.eod

    def loop() -> int:
        tokens = 0
        for path in sorted(shard.glob("*.jsonl")):
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        tokens += len(np.array(tokenizer.encode(document_text(line).rstrip()) + [eod], dtype=np.int64))
        return tokens

    def build(count: int) -> int:
        root = workdir / f"build_store_{count}"
        shutil.rmtree(root, ignore_errors=True)
        fresh = make_task(shard.parent.parent, vocab, merges).tokenizer  # no pieces cached by an earlier run (load time counted)
        tokens = open_store(root, "train", shard, fresh, eod, workers=count).meta["tokens"]
        shutil.rmtree(root)
        return tokens

    sides = {"loop": loop, **{f"store, --workers {count}": partial(build, count) for count in workers}}
    seconds: Dict[str, List[float]] = {name: [] for name in sides}
    counts = set()
    for _ in range(repeats):  # the sides alternate, so that load on a shared machine hits them alike
        for name, side in sides.items():
            started = time.perf_counter()
            counts.add(side())
            seconds[name].append(time.perf_counter() - started)
    assert len(counts) == 1, counts  # every side produced the same tokens
    tokens = counts.pop()
    rows = {name: {"seconds": statistics.median(times), "all_seconds": times} for name, times in seconds.items()}
    for row in rows.values():
        row.update(mb_s=size / 1e6 / row["seconds"], tokens_s=tokens / row["seconds"])
    loop_seconds = rows["loop"]["seconds"]
    print(f"\n(a) token store build: {size / 1e6:.0f} MB of jsonl, {tokens:,} tokens, vocabulary {tokenizer.vocab_size}")
    print(f"median of {repeats} runs each, taken in turn")
    print("| | seconds | jsonl MB/s | tokens/s | vs loop |\n|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['seconds']:.1f} | {row['mb_s']:.2f} | {row['tokens_s']:,.0f} | {loop_seconds / row['seconds']:.2f}x |")
    return {"megabytes": size / 1e6, "tokens": tokens, "rows": rows}


# ---- (b) resume cost -----------------------------------------------------------------------


def old_batch_iterator(task, batch_size: int, seed: int):
    """The training iterator before the token store: the epoch's stream read and tokenized front
    to back on every rank, and a resume dropping the batches before it (uncollated)."""
    from metaseq_ds.data import DocumentToSequenceDataset, EpochBatchIterator, JsonlSplit, collate_blocks
    from metaseq_ds.data.iterators import collated_batches, rank_rows

    args = task.args
    dataset = DocumentToSequenceDataset(JsonlSplit(task.data_dir, "train").documents, task.tokenize,
                                        args.tokens_per_sample + 1, args.sample_break_mode, shuffle=True, drop_last=True)
    collate = partial(collate_blocks, pad=task.dictionary.pad(), tokens_per_sample=args.tokens_per_sample,
                      break_mode=args.sample_break_mode)

    def batches_for_epoch(epoch: int, skip: int):
        rows = rank_rows(dataset.samples(epoch, seed), batch_size, 1, 0, fill_last=False)
        return collated_batches(rows, skip, collate, what="train")

    return EpochBatchIterator(batches_for_epoch)


def first_batch(make_iterator, iteration: int):
    """Seconds from nothing (a fresh task) to the first batch at `iteration` of epoch 1, and the batch."""
    started = time.perf_counter()
    epochs = make_iterator()
    if iteration:
        epochs.load_state_dict({"epoch": 1, "iterations_in_epoch": iteration})
    batch = next(epochs.next_epoch_itr())
    return time.perf_counter() - started, batch


def bench_resume(data: Path, vocab: Path, merges: Path, iteration: int) -> Dict:
    rows = {}
    for mode in ("none", "complete"):
        values = {"tokens_per_sample": 256, "sample_break_mode": mode}
        task = make_task(data, vocab, merges, **values)
        task.load_dataset("train")  # the store is built (once) before anything is timed
        samples = len(task.datasets["train"].epoch(1, 1))
        if samples <= iteration:
            raise SystemExit(f"the corpus has {samples:,} samples of 256 tokens: too few for iteration {iteration:,} "
                             "at batch 1; raise --corpus-mb or lower --resume-iteration")
        new = lambda: make_task(data, vocab, merges, **values).get_batch_iterator("train", batch_size=1, seed=1)  # noqa: E731
        old = lambda: old_batch_iterator(make_task(data, vocab, merges, **values), batch_size=1, seed=1)  # noqa: E731
        sides = [("indexed", new, (0, iteration))]
        if mode == "none":
            sides.append(("before the store", old, (0, iteration // 10, iteration)))
        for side, make, iterations in sides:
            for at in iterations:
                seconds, batch = first_batch(make, at)
                rows[(mode, side, at)] = {"seconds": seconds, "ids": batch["id"].tolist(),
                                          "tokens": batch["net_input"]["src_tokens"].tolist()}
        for at in (0, iteration):  # same batch either way
            if (mode, "before the store", at) in rows:
                assert rows[(mode, "before the store", at)]["tokens"] == rows[(mode, "indexed", at)]["tokens"]
    print("\n(b) resume: seconds from a fresh task to the first batch (batch 1, 256 tokens; BPE corpus)")
    print("| break mode | path | iteration | seconds |\n|---|---|---|---|")
    for (mode, side, at), row in rows.items():
        print(f"| {mode} | {side} | {at:,} | {row['seconds']:.2f} |")
    for mode in ("none", "complete"):
        gap = rows[(mode, "indexed", iteration)]["seconds"] - rows[(mode, "indexed", 0)]["seconds"]
        print(f"indexed, {mode}: iteration {iteration:,} - iteration 0 = {gap:+.2f} s (target < 1 s)")
    return {f"{mode}|{side}|{at}": row["seconds"] for (mode, side, at), row in rows.items()}


# ---- (c) end-to-end training: does the step wait on data? -----------------------------------


def train_flags(data: Path, vocab: Path, merges: Path, args) -> List[str]:
    model = ["--arch", "transformer_lm", "--decoder-embed-dim", str(args.dim), "--decoder-layers", str(args.layers),
             "--decoder-attention-heads", str(args.dim // 64), "--decoder-ffn-embed-dim", str(4 * args.dim),
             "--decoder-learned-pos", "--decoder-normalize-before", "--share-decoder-input-output-embed",
             "--no-scale-embedding", "--activation-fn", "relu", "--dropout", "0.1"]
    return [str(data), *tokenizer_flags(vocab, merges), *model, "--tokens-per-sample", str(args.seq), "--batch-size",
            str(args.batch), "--optimizer", "adam", "--lr", "1e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "1",
            "--max-update", str(args.updates), "--log-interval", str(args.log_interval), "--log-format", "json",
            "--progress-bar", "none", "--disable-validation", "--no-save", "--seed", "1"]


def step_only(flags: List[str]) -> None:
    """`mseq train`'s set-up for one process, then `Trainer.train_step` over batches already in
    memory, timed per --log-interval window as the training log times its windows."""
    import torch

    from metaseq_ds import tasks
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import parse_train_config
    from metaseq_ds.trainer import Trainer

    cfg = parse_train_config(flags)
    dist_utils.init_distributed(cfg.distributed_training.distributed_port)
    torch.manual_seed(cfg.common.seed)
    task = tasks.setup_task(cfg.task)
    criterion = task.build_criterion(cfg.criterion)
    ds_config = build_deepspeed_config(cfg, 1, **accelerator_traits())
    model = build_model(cfg, task, criterion, lambda model: InitialValues(model, model.init_seed), None)
    trainer = Trainer(cfg, task, model, criterion, ds_config)
    itr = task.get_batch_iterator("train", batch_size=cfg.dataset.batch_size, seed=cfg.common.seed).next_epoch_itr()
    batches = [next(itr) for _ in range(cfg.optimization.max_update)]
    interval, wps = cfg.common.log_interval, []
    for start in range(0, len(batches), interval):
        window = batches[start : start + interval]
        began = time.perf_counter()
        for batch in window:
            trainer.train_step([batch])
        wps.append(sum(batch["ntokens"] for batch in window) / (time.perf_counter() - began))
    print(STEP_ONLY_MARKER + json.dumps({"wps": wps}), flush=True)


def run_json(command: List[str], cwd: Path, marker: str) -> List[dict]:
    """The JSON objects a command prints after `marker` on a line."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{result.stderr[-3000:]}")
    return [json.loads(line.split(marker, 1)[1]) for line in result.stdout.splitlines() if marker in line]


def bench_train(data: Path, vocab: Path, merges: Path, args, workdir: Path) -> Dict:
    flags = train_flags(data, vocab, merges, args)
    make_task(data, vocab, merges, tokens_per_sample=args.seq).token_stores("train")  # not timed: built before

    def run(side: str) -> float:
        if side == "mseq train":
            records = run_json([sys.executable, "-m", "metaseq_ds.cli.main", "train", *flags], workdir, "| train_inner | ")
            wps = [r["wps"] for r in records]
        else:
            wps = run_json([sys.executable, "-m", "benchmarks.data", "--step-only", json.dumps(flags)], ROOT, STEP_ONLY_MARKER)[-1]["wps"]
        print(f"  {side}: wps per window {[round(w) for w in wps]}", flush=True)
        return statistics.median(wps[1:])  # the first window holds the warm-up

    pairs = []
    for index in range(args.pairs):  # AB, BA, AB, ...: load that drifts hits both sides alike
        order = ("train_step only", "mseq train") if index % 2 == 0 else ("mseq train", "train_step only")
        pairs.append({side: run(side) for side in order})
    ratios = [pair["mseq train"] / pair["train_step only"] for pair in pairs]
    ratio = statistics.median(ratios)
    print(f"\n(c) end to end: {args.corpus_mb} MB of jsonl, width {args.dim}, {args.layers} layers, the BPE's vocabulary, "
          f"batch {args.batch} x {args.seq} tokens, fp32, 1 process; median wps of the {args.log_interval}-update windows "
          "after the first, per run")
    print("| pair | train_step only wps | mseq train wps | ratio |\n|---|---|---|---|")
    for index, (pair, pair_ratio) in enumerate(zip(pairs, ratios), start=1):
        print(f"| {index} | {pair['train_step only']:,.0f} | {pair['mseq train']:,.0f} | {pair_ratio:.3f} |")
    verdict = "meets" if ratio >= 0.97 else "misses"
    print(f"mseq train / train_step only, median of {len(pairs)} pairs = {ratio:.3f} ({(ratio - 1) * 100:+.1f}%; {verdict} the "
          "target: no more than 3% below, i.e. the step never waits on data)")
    return {"pairs": pairs, "ratios": ratios, "ratio": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="build,resume,train", help="comma-separated: build, resume, train")
    parser.add_argument("--workdir", type=Path, help="keep the corpus, tokenizer and stores here (default: a temporary folder)")
    parser.add_argument("--corpus-mb", type=int, default=200, help="train jsonl generated for (b) and (c)")
    parser.add_argument("--build-mb", type=int, default=32, help="jsonl of the build comparison (a)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts of (a)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side of (a), in turn")
    parser.add_argument("--merges", type=int, default=50_000)
    parser.add_argument("--resume-iteration", type=int, default=50_000)
    parser.add_argument("--updates", type=int, default=40, help="updates of each run of (c)")
    parser.add_argument("--pairs", type=int, default=4, help="(c): pairs of runs, the sides alternating")
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256, help="(c): tokens per sample")
    parser.add_argument("--batch", type=int, default=4, help="(c): micro-batch")
    parser.add_argument("--dim", type=int, default=128, help="(c): model width (heads of 64)")
    parser.add_argument("--layers", type=int, default=2, help="(c): model layers")
    parser.add_argument("--quick", action="store_true", help="24 MB corpus, 8 MB build, iteration 5,000, 2 pairs of 20 updates")
    parser.add_argument("--step-only", help=argparse.SUPPRESS)  # (c)'s train_step-only side, in its own process
    args = parser.parse_args()
    if args.step_only:
        return step_only(json.loads(args.step_only))
    if args.quick:
        args.corpus_mb, args.build_mb, args.resume_iteration, args.updates, args.pairs = 24, 8, 5_000, 20, 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="metaseq_ds_data_bench_"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    data, vocab, merges = prepare(workdir, args.corpus_mb, args.merges)
    results = {"cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    parts = args.parts.split(",")
    if "build" in parts:
        results["build"] = bench_build(data, vocab, merges, args.build_mb, workdir, args.workers, args.repeats)
    if "resume" in parts:
        results["resume"] = bench_resume(data, vocab, merges, args.resume_iteration)
    if "train" in parts:
        results["train"] = bench_train(data, vocab, merges, args, workdir)
    results["load_average_at_end"] = os.getloadavg()
    (workdir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"\nall parts: {time.perf_counter() - started:.0f} s; load average (1/5/15 min) at start {results['load_average_at_start']}, "
          f"at end {results['load_average_at_end']}; results in {workdir / 'results.json'}")
    if not args.workdir:
        shutil.rmtree(workdir / "corpus", ignore_errors=True)


if __name__ == "__main__":
    main()
