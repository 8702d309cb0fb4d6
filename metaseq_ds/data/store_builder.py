"""Tokenize the jsonl files of one shard into a token store's arrays, in parallel.

The files are cut into line-aligned chunks of about `CHUNK_BYTES`; worker processes each read
a chunk, parse its lines and encode the documents with the tokenizer's batch encoding (one
thread per process, so N processes use N cores: the JSON parsing, the list -> array
conversion and the exact ASCII fast path of byte-level BPE (`bytelevel_ascii`) are Python
work that threads would serialize). The calling process writes the
chunks' tokens in order, so the store's document order is the files' line order whatever the
number of workers. With one worker everything runs in the calling process.

A malformed line stops the build with one line naming file:line (line numbers are counted
per chunk by the workers and added up here, in order).
"""

import itertools
import logging
import multiprocessing
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple, Union

import numpy as np

from metaseq_ds.data.jsonl_record import MalformedLine, document_text
from metaseq_ds.errors import UsageError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer type that holds every id of the vocabulary."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocabulary of {vocab_size} ids does not fit 32 bits")


def default_workers() -> int:
    """The CPUs this process may run on: the builder has the machine while the other ranks wait."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclass(frozen=True)
class Chunk:
    path: Path
    start: int  # byte offsets, at line starts
    end: int


@dataclass(frozen=True)
class EncodedChunk:
    tokens: np.ndarray  # the documents' tokens, each followed by the end-of-document id
    lengths: np.ndarray  # int64, tokens per document (end-of-document included)
    lines: int  # lines in the chunk, blank ones included (to number the next chunk's lines)


@dataclass(frozen=True)
class BadLine:
    line: int  # 1-based, within the chunk
    problem: str


def line_aligned_chunks(path: Path, chunk_bytes: Optional[int] = None) -> List[Chunk]:
    chunk_bytes = chunk_bytes or CHUNK_BYTES  # read at call time, so that tests can make chunks small
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + chunk_bytes < size:
            f.seek(bounds[-1] + chunk_bytes)
            f.readline()  # to the start of the next line
            if f.tell() >= size:
                break
            bounds.append(f.tell())
    bounds.append(size)
    return [Chunk(path, start, end) for start, end in zip(bounds[:-1], bounds[1:]) if end > start]


class ChunkEncoder:
    """Reads, parses and encodes one chunk (picklable: it is sent to each worker once)."""

    def __init__(self, tokenizer, eod: int, dtype: np.dtype):
        self.tokenizer, self.eod, self.dtype = tokenizer, eod, dtype

    def __call__(self, chunk: Chunk) -> Union[EncodedChunk, BadLine]:
        with open(chunk.path, "rb") as f:
            f.seek(chunk.start)
            lines = f.read(chunk.end - chunk.start).split(b"\n")
        if lines[-1] == b"":  # the chunk ends with a newline
            lines.pop()
        texts = []
        for number, line in enumerate(lines, start=1):
            if line.strip():  # blank lines hold no document, as in JsonlDataset
                try:
                    texts.append(document_text(line).rstrip())
                except MalformedLine as error:
                    return BadLine(number, str(error))
        ids = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(doc) + 1 for doc in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()) - len(ids))
        tokens = np.insert(flat, np.cumsum(lengths - 1), np.array(self.eod, dtype=self.dtype))
        return EncodedChunk(tokens, lengths, len(lines))


def build_shard_arrays(
    shard: Path,
    files: List[Path],
    encoder: ChunkEncoder,
    out_dir: Path,
    workers: int,
    progress: Optional[Callable[[int], None]] = None,
) -> Tuple[int, int]:
    """Write `tokens.bin` and `offsets.npy` for the documents of `files` into `out_dir`.

    Returns (documents, tokens). `progress(n)` is called with the jsonl bytes of each chunk done.
    """
    chunks = [chunk for path in files for chunk in line_aligned_chunks(path)]
    workers = max(1, min(workers, len(chunks)))
    started = time.perf_counter()
    lengths: List[np.ndarray] = []
    lines_before = 0  # lines of the current file in the chunks already written
    with open(out_dir / TOKENS_FILE, "wb") as out:
        for index, (chunk, result) in enumerate(zip(chunks, _encoded(chunks, encoder, workers))):
            if index > 0 and chunks[index - 1].path != chunk.path:
                lines_before = 0
            if isinstance(result, BadLine):
                raise UsageError(f"{chunk.path}:{lines_before + result.line}: {result.problem}")
            lines_before += result.lines
            result.tokens.tofile(out)
            lengths.append(result.lengths)
            if progress is not None:
                progress(chunk.end - chunk.start)
    document_lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
    if len(document_lengths) == 0:
        raise UsageError(f"{shard} holds no documents: its *.jsonl files have no non-blank lines")
    offsets = np.zeros(len(document_lengths) + 1, dtype=np.int64)
    np.cumsum(document_lengths, out=offsets[1:])
    np.save(out_dir / OFFSETS_FILE, offsets)
    seconds = time.perf_counter() - started
    size = sum(chunk.end - chunk.start for chunk in chunks)
    logger.info(f"tokenized {shard}: {len(document_lengths):,} documents, {int(offsets[-1]):,} tokens from "
                f"{size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.1f} MB/s, {workers} worker(s))")
    return len(document_lengths), int(offsets[-1])


def _encoded(chunks: List[Chunk], encoder: ChunkEncoder, workers: int) -> Iterator[Union[EncodedChunk, BadLine]]:
    """The chunks' results in order; at most 2 chunks per worker in flight (bounded memory)."""
    if workers == 1:
        yield from map(encoder, chunks)
        return
    # forkserver, not fork: the caller may be a training process with threads (gloo, data
    # prefetch) that a fork would copy mid-lock. Workers fork from a server that imported this
    # module once, so none of them pays the imports again.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    pending: List[Future] = []
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)) as pool:
        try:
            queued = iter(chunks)
            for chunk in itertools.islice(queued, 2 * workers):
                pending.append(pool.submit(_encode_in_worker, chunk))
            while pending:
                result = pending.pop(0).result()
                for chunk in itertools.islice(queued, 1):
                    pending.append(pool.submit(_encode_in_worker, chunk))
                yield result
        finally:
            for future in pending:
                future.cancel()


_worker_encoder: Optional[ChunkEncoder] = None


def _start_worker(encoder: ChunkEncoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the processes fill the cores
    _worker_encoder = encoder


def _encode_in_worker(chunk: Chunk) -> Union[EncodedChunk, BadLine]:
    return _worker_encoder(chunk)
