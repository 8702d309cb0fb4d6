"""A small corpus in metaseq's layout, built from text every machine has: Python's stdlib sources.

`mseq train` without DATA trains on it, so that a first run needs no download:

    <out_dir>/train/00/stdlib.jsonl
    <out_dir>/valid/00/stdlib.jsonl
    <out_dir>/demo_corpus.json      what it was built from (max_bytes, Python version)

Each top-level chunk of a `.py` file (module header, each top-level def or class) is one
document. Files are visited in an order fixed by a hash of their path (so a few MB sample the
whole library); the same hash sends one file in 20 to valid, so validation text comes from
files the model never trained on. Each split fills its share of `max_bytes` (valid: 1/20)
with whole files. The corpus depends only on `max_bytes` and the Python version.
It is built in a temporary directory and renamed into place, so concurrent ranks are safe.
`unigram_entropy` gives the bits per token of a model that knows only byte frequencies:
the baseline a demo run's validation loss should fall below.
"""

import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import zlib
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from metaseq_ds.data.jsonl import JsonlSplit
from metaseq_ds.data.tokenizers import ByteTokenizer
from metaseq_ds.errors import UsageError

DEFAULT_MAX_BYTES = 3_000_000
VALID_ONE_IN = 20  # about 5% of the files are validation files
MARKER = "demo_corpus.json"
_TOP_LEVEL = re.compile(r"\n(?=(?:async def |def |class |@))")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_demo_dir(max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "metaseq_ds" / f"demo_corpus_{max_bytes}"


def build_demo_corpus(out_dir: Optional[Path] = None, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Write (or reuse) the demo corpus under `out_dir` and return that directory."""
    out_dir = Path(out_dir) if out_dir is not None else default_demo_dir(max_bytes)
    identity = {"max_bytes": max_bytes, "python": sys.version.split()[0]}
    if out_dir.exists():
        if _identity(out_dir) == identity:
            return out_dir
        if _identity(out_dir) is None:
            raise UsageError(f"{out_dir} exists and is not a demo corpus; choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo_corpus_", dir=out_dir.parent))
    _write_corpus(staging, max_bytes)
    (staging / MARKER).write_text(json.dumps(identity))
    stale = out_dir.with_name(f".{out_dir.name}.stale.{os.getpid()}")
    if out_dir.exists():  # a demo corpus of another size or Python: replace it
        try:
            os.rename(out_dir, stale)
        except FileNotFoundError:  # another process moved it away first
            pass
    try:
        os.rename(staging, out_dir)
    except OSError:  # another process renamed its copy into place first; it is identical
        shutil.rmtree(staging)
    shutil.rmtree(stale, ignore_errors=True)
    return out_dir


def _identity(out_dir: Path):
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_corpus(root: Path, max_bytes: int) -> None:
    documents: Dict[str, List[str]] = {"train": [], "valid": []}
    for split, text in _stdlib_documents(max_bytes):
        documents[split].append(json.dumps({"text": text}))
    for split, lines in documents.items():
        shard = root / split / "00"
        shard.mkdir(parents=True)
        (shard / "stdlib.jsonl").write_text("\n".join(lines) + "\n")


def _stdlib_documents(max_bytes: int) -> Iterator[Tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [
        path
        for path in stdlib.rglob("*.py")
        if not _SKIPPED_DIRS.intersection(path.relative_to(stdlib).parts[:-1])
    ]
    files.sort(key=lambda path: (_path_hash(path, stdlib), path.as_posix()))
    budget = {"valid": max_bytes // VALID_ONE_IN, "train": max_bytes - max_bytes // VALID_ONE_IN}
    for path in files:
        split = "valid" if _path_hash(path, stdlib) % VALID_ONE_IN == 0 else "train"
        if budget[split] <= 0:
            if all(left <= 0 for left in budget.values()):
                return
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for chunk in _TOP_LEVEL.split(source):
            if chunk.strip():
                yield split, chunk
                budget[split] -= len(chunk.encode("utf-8"))


def _path_hash(path: Path, stdlib: Path) -> int:
    return zlib.crc32(path.relative_to(stdlib).as_posix().encode("utf-8"))


def unigram_entropy(data: Path, split: str = "valid") -> float:
    """Entropy in bits per token of the byte-token unigram distribution of a split (all shards).

    The tokens are those the byte tokenizer gives the model: the UTF-8 bytes of each
    document's rstripped text plus one end-of-document token, so the number is directly
    comparable with a byte-tokenizer model's loss in bits (about bits per byte, the one
    end-of-document token per document being a small share).
    """
    tokenizer = ByteTokenizer()
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    jsonl = JsonlSplit(data, split)
    for epoch in range(1, len(jsonl.shards) + 1):
        documents = jsonl.documents(epoch)
        for i in range(len(documents)):
            text = documents[i].rstrip().encode("utf-8")
            counts[tokenizer.offset :] += np.bincount(np.frombuffer(text, dtype=np.uint8), minlength=256)
        counts[tokenizer.token_to_id("</s>")] += len(documents)  # one end-of-document token each
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())
