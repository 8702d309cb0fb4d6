"""The token store: a shard's documents tokenized once, memory-mapped, addressable by document.

One store per (shard directory, tokenizer, end-of-document id):

    <root>/<split>/<shard>/<files key>-<tokenizer key>/
        tokens.bin     every document's ids followed by the end-of-document id, concatenated
                       in the shard's document order, in the smallest unsigned dtype that
                       holds the vocabulary (uint16 for GPT-2's 50k ids)
        offsets.npy    int64, documents + 1 entries: document d is tokens[offsets[d]:offsets[d+1]]
        meta.json      what it was built from: the files (name, size, mtime), the tokenizer's
                       fingerprint, vocabulary size, end-of-document id, dtype, counts

`<root>` is `DATA/.token_store`, beside the data, or `--data-cache-dir`/<data name>-<hash of
its path>. The directory name is a hash of the files' names, sizes and mtimes and of the
tokenizer's fingerprint (its whole serialized form) and the end-of-document id, so that
changing a file, the tokenizer or the end-of-document symbol selects another store; the break
mode does not enter: the blocks of every break mode are computed per epoch from the offsets
(`metaseq_ds.data.sample_index`). When opened, meta.json and the file sizes are checked again
against what this run expects; a store that disagrees (copied, tampered with, of another
format) is rebuilt, never read with another tokenizer's ids. A store of files that have since
changed is deleted when its replacement is built.

Building is atomic and done once per machine: the first process takes a file lock
(`filelock`), builds in a temporary directory beside the store and renames it into place; the
others wait on the lock and then open what it built. A crash leaves at worst a temporary
directory, removed by the next build, never a half store.

Why numpy memory maps rather than Arrow (Hugging Face `datasets`) or litdata: the store is two
integer arrays, which numpy maps with zero copies and no schema, at the cost of reading a
sample being a slice; `datasets` would add pyarrow and per-row overhead for the same slices,
and litdata's chunked streaming has its own shuffling and sharding, which would not reproduce
our sample stream (the order must not depend on the number of ranks). Megatron's indexed
dataset is the same design (`.bin` + `.idx`).
"""

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from metaseq_ds.data.jsonl import shard_files
from metaseq_ds.data.store_builder import OFFSETS_FILE, TOKENS_FILE, ChunkEncoder, build_shard_arrays, token_dtype
from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout or the way documents are encoded changes
STORE_DIR_NAME = ".token_store"
META_FILE = "meta.json"


class TokenStore:
    """A built store, opened read-only: `document(d)` is its tokens, `lengths` all documents' lengths."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta
        self.offsets: np.ndarray = np.load(path / OFFSETS_FILE)
        self._tokens: Optional[np.ndarray] = None  # mapped on first read, in the process that reads

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            self._tokens = np.memmap(self.path / TOKENS_FILE, dtype=self.meta["dtype"], mode="r", shape=(self.meta["tokens"],))
        return self._tokens

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def __getstate__(self):  # a worker process maps the file itself rather than receive a copy
        return {**self.__dict__, "_tokens": None}


@dataclass(frozen=True)
class StoreRequest:
    """What a store must have been built from."""

    shard: Path
    files: List[dict]  # name, size, mtime_ns of each jsonl file, in document order
    tokenizer: str  # the tokenizer's fingerprint
    vocab_size: int
    eod: int

    @classmethod
    def for_shard(cls, shard: Path, tokenizer, eod: int) -> "StoreRequest":
        files = []
        for path in shard_files(shard):
            stat = path.stat()
            files.append({"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
        return cls(shard, files, tokenizer.fingerprint(), tokenizer.vocab_size, eod)

    @property
    def files_key(self) -> str:
        return _digest({"format": FORMAT, "files": self.files})

    @property
    def key(self) -> str:
        tokenizer = _digest({"format": FORMAT, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "eod": self.eod})
        return f"{self.files_key}-{tokenizer}"

    def expected_meta(self) -> dict:
        return {"format": FORMAT, "files": self.files, "tokenizer": self.tokenizer, "vocab_size": self.vocab_size,
                "eod": self.eod, "dtype": token_dtype(self.vocab_size).name}


def store_root(data: Path, cache_dir: Optional[str]) -> Path:
    """Where the stores of a data directory live: beside it, or under --data-cache-dir."""
    data = Path(data).resolve()
    if not cache_dir:
        return data / STORE_DIR_NAME
    return Path(cache_dir) / f"{data.name}-{_digest(str(data))[:8]}"


def open_store(
    root: Path,
    split: str,
    shard: Path,
    tokenizer,
    eod: int,
    workers: int,
    progress: Optional[Callable[[int], None]] = None,
) -> TokenStore:
    """The store of `shard`, built first if no valid one exists (by one process; the others wait)."""
    from filelock import FileLock

    request = StoreRequest.for_shard(shard, tokenizer, eod)
    folder = root / split / shard.name
    path = folder / request.key
    store = _open_valid(path, request, quiet=True)
    if store is not None:
        return store
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(folder / f"{request.key}.lock"))
        lock.acquire()
    except OSError as error:
        raise UsageError(f"cannot write the token store in {folder} ({error.strerror or error}); "
                         "give --data-cache-dir DIR, a writable directory") from None
    try:
        store = _open_valid(path, request)  # built by another process while this one waited
        if store is None:
            _build(path, request, tokenizer, workers, progress)
            _remove_stale(folder, request)
            store = _open_valid(path, request)
        return store
    finally:
        lock.release()


def _open_valid(path: Path, request: StoreRequest, quiet: bool = False) -> Optional[TokenStore]:
    """The store at `path` if it is complete and was built from exactly what `request` names
    (`quiet`: say nothing of an unusable one, which is looked at again under the lock)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        expected = request.expected_meta()
        if {name: meta.get(name) for name in expected} != expected:
            raise ValueError("built from other files or another tokenizer")
        itemsize = np.dtype(meta["dtype"]).itemsize
        if (path / TOKENS_FILE).stat().st_size != meta["tokens"] * itemsize:
            raise ValueError(f"{TOKENS_FILE} does not hold {meta['tokens']} tokens")
        store = TokenStore(path, meta)
        if len(store) != meta["documents"] or int(store.offsets[-1]) != meta["tokens"]:
            raise ValueError(f"{OFFSETS_FILE} does not match {META_FILE}")
        return store
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as problem:
        if not quiet:
            logger.warning(f"token store {path} is not usable ({problem}): rebuilding it")
        return None


def _build(path: Path, request: StoreRequest, tokenizer, workers: int, progress) -> None:
    """Build into a temporary directory, then rename: the store appears whole or not at all."""
    for leftover in path.parent.glob(f".{path.name}.tmp-*"):  # from a crashed build (we hold the lock)
        shutil.rmtree(leftover, ignore_errors=True)
    if path.exists():  # present but not usable (see _open_valid)
        shutil.rmtree(path)
    staging = path.parent / f".{path.name}.tmp-{os.getpid()}"
    staging.mkdir()
    try:
        meta = request.expected_meta()
        encoder = ChunkEncoder(tokenizer, request.eod, np.dtype(meta["dtype"]))
        files = [request.shard / entry["name"] for entry in request.files]
        documents, tokens = build_shard_arrays(request.shard, files, encoder, staging, workers, progress)
        meta.update(documents=documents, tokens=tokens, shard=str(request.shard))
        (staging / META_FILE).write_text(json.dumps(meta, indent=1))
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _remove_stale(folder: Path, request: StoreRequest) -> None:
    """Stores of this shard built from files that have since changed can never be used again."""
    for other in folder.iterdir():
        if other.is_dir() and not other.name.startswith((request.files_key, ".")):
            shutil.rmtree(other, ignore_errors=True)  # (its lock file stays: a process may hold it)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()[:16]
