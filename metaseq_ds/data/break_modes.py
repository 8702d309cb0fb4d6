"""Documents -> fixed-size training samples (metaseq's `--sample-break-mode`).

A block holds up to `block_size` = tokens_per_sample + 1 tokens, so that src = block[:-1] and
target = block[1:] give the model exactly tokens_per_sample positions. Break modes:

    none         concatenate all documents and cut into full blocks (the streaming LM default)
    complete     pack whole documents into blocks without splitting them, then pad;
                 a document longer than a block is cut into block-size pieces first
    eos_pad_8    one document per sample (long ones cut into block-size pieces); the batch is
                 padded to the longest sample, rounded up to a multiple of 8
    passthrough  one document per sample, truncated to a block

Document order is shuffled per epoch (seeded by seed and epoch) for training splits only.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from metaseq_ds.errors import UsageError

BREAK_MODES = ("none", "complete", "eos_pad_8", "passthrough")


def document_blocks(documents: Iterable[np.ndarray], block_size: int, break_mode: str, drop_last: bool) -> Iterator[np.ndarray]:
    """Blocks of at most `block_size` tokens, in document order.

    `drop_last` drops the final partial block of mode `none` (metaseq does so for training);
    the other modes pad every block, so a short final block is an ordinary sample.
    """
    if break_mode == "none":
        yield from _concatenate_and_cut(documents, block_size, drop_last)
    elif break_mode == "complete":
        yield from _pack_whole_documents(documents, block_size)
    elif break_mode == "eos_pad_8":
        for document in documents:
            for start in range(0, len(document), block_size):
                piece = document[start : start + block_size]
                if len(piece) > 1:  # a single token has no next token to predict
                    yield piece
    elif break_mode == "passthrough":
        for document in documents:
            if len(document) > 1:
                yield document[:block_size]
    else:
        raise UsageError(f"--sample-break-mode: unknown mode {break_mode!r} (choose from {', '.join(BREAK_MODES)})")


def _concatenate_and_cut(documents: Iterable[np.ndarray], block_size: int, drop_last: bool) -> Iterator[np.ndarray]:
    pending: List[np.ndarray] = []
    pending_size = 0
    for document in documents:
        pending.append(document)
        pending_size += len(document)
        if pending_size >= block_size:
            joined = np.concatenate(pending)
            full = len(joined) // block_size * block_size
            yield from joined[:full].reshape(-1, block_size)
            pending, pending_size = [joined[full:]], len(joined) - full
    if pending_size and not drop_last:
        yield np.concatenate(pending)


def _pack_whole_documents(documents: Iterable[np.ndarray], block_size: int) -> Iterator[np.ndarray]:
    block: List[np.ndarray] = []
    block_fill = 0
    for document in documents:
        for start in range(0, len(document), block_size):
            piece = document[start : start + block_size]
            if block_fill + len(piece) > block_size:
                yield np.concatenate(block)
                block, block_fill = [], 0
            block.append(piece)
            block_fill += len(piece)
    if block:
        yield np.concatenate(block)


def document_order(count: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """The order in which an epoch visits its `count` documents: shuffled by (seed, epoch), or as stored."""
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng([seed % 2**32, epoch]).permutation(count)


class DocumentToSequenceDataset:
    """The sample stream of one split: an epoch's documents, tokenized on the fly, cut into blocks.

    The stream depends only on the documents, the tokenizer, the epoch, the seed, the block
    size and the break mode: never on the number of ranks or the batch size, so that runs
    with different parallelism see the same data in the same order.

    This is the definition of the stream, read front to back (metaseq's dataset name, for
    code that builds one). The task reads the same samples by index from a token store
    (`metaseq_ds.data.sample_index`); tests and `benchmarks/data.py` compare the two.
    """

    def __init__(
        self,
        documents_for_epoch: Callable[[int], Sequence[str]],
        tokenize: Callable[[str], np.ndarray],
        block_size: int,
        break_mode: str,
        shuffle: bool,
        drop_last: bool,
    ):
        if break_mode not in BREAK_MODES:
            raise UsageError(f"--sample-break-mode: unknown mode {break_mode!r} (choose from {', '.join(BREAK_MODES)})")
        self.documents_for_epoch = documents_for_epoch
        self.tokenize = tokenize
        self.block_size = block_size
        self.break_mode = break_mode
        self.shuffle = shuffle
        self.drop_last = drop_last

    def document_order(self, epoch: int, seed: int) -> np.ndarray:
        return document_order(len(self.documents_for_epoch(epoch)), epoch, seed, self.shuffle)

    def samples(self, epoch: int, seed: int) -> Iterator[np.ndarray]:
        documents = self.documents_for_epoch(epoch)
        tokens = (self.tokenize(documents[i]) for i in self.document_order(epoch, seed))
        return document_blocks(tokens, self.block_size, self.break_mode, self.drop_last)


def collate_blocks(rows: List[Tuple[int, Optional[np.ndarray]]], pad: int, tokens_per_sample: int, break_mode: str) -> Dict[str, Any]:
    """A micro-batch in metaseq's format from (sample id, block or None for a filler row) rows.

    T is tokens_per_sample for `none` and `complete`; for the one-document modes it is the
    longest sample (`eos_pad_8`: rounded up to a multiple of 8, at most tokens_per_sample).
    Padding and filler positions are pad in both src_tokens and target, so `ntokens`, the
    count of non-pad targets, is what the loss is averaged over.
    """
    if break_mode in ("none", "complete"):
        length = tokens_per_sample
    else:
        length = max([len(block) - 1 for _, block in rows if block is not None] + [1])
        if break_mode == "eos_pad_8":
            length = min(-(-length // 8) * 8, tokens_per_sample)
    tokens = torch.full((len(rows), length + 1), pad, dtype=torch.long)
    for row, (_, block) in enumerate(rows):
        if block is not None:
            tokens[row, : len(block)] = torch.from_numpy(block)
    target = tokens[:, 1:].contiguous()
    return {
        "id": torch.tensor([sample_id for sample_id, _ in rows], dtype=torch.long),
        "net_input": {"src_tokens": tokens[:, :-1].contiguous()},
        "target": target,
        "ntokens": int(target.ne(pad).sum()),
        "nsentences": sum(block is not None for _, block in rows),
    }
