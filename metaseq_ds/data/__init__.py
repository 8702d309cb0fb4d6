"""Data: dictionary, tokenizers, metaseq's jsonl layout, break modes, token stores and the batch iterator.

metaseq code imports `Dictionary`, `BaseDataset` (fairseq's `FairseqDataset`), `JsonlDataset`,
`DocumentToSequenceDataset` and `iterators` from here.

The names below are imported on first use (PEP 562), so that importing one submodule does not
import torch: the token store's tokenizing worker processes import only
`metaseq_ds.data.store_builder` and `metaseq_ds.data.tokenizers`, and start in a fraction of
a second instead of the seconds torch takes.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, for readers of the source: type checkers and `mseq migrate`'s resolver
    from metaseq_ds.data import iterators
    from metaseq_ds.data.base_dataset import BaseDataset
    from metaseq_ds.data.break_modes import BREAK_MODES, DocumentToSequenceDataset, collate_blocks, document_blocks
    from metaseq_ds.data.demo_corpus import build_demo_corpus, default_demo_dir, unigram_entropy
    from metaseq_ds.data.dictionary import SPECIAL_SYMBOLS, Dictionary
    from metaseq_ds.data.iterators import CountingIterator, EpochBatchIterator
    from metaseq_ds.data.jsonl import JsonlDataset, JsonlSplit, list_splits, shard_dirs
    from metaseq_ds.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

_MODULE_OF = {
    "iterators": None,  # the submodule itself
    "BaseDataset": "base_dataset",
    "build_demo_corpus": "demo_corpus",
    "default_demo_dir": "demo_corpus",
    "unigram_entropy": "demo_corpus",
    "SPECIAL_SYMBOLS": "dictionary",
    "Dictionary": "dictionary",
    "BREAK_MODES": "break_modes",
    "DocumentToSequenceDataset": "break_modes",
    "collate_blocks": "break_modes",
    "document_blocks": "break_modes",
    "CountingIterator": "iterators",
    "EpochBatchIterator": "iterators",
    "JsonlDataset": "jsonl",
    "JsonlSplit": "jsonl",
    "list_splits": "jsonl",
    "shard_dirs": "jsonl",
    "ByteTokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
}

__all__ = [  # _MODULE_OF's names, written out so that pyflakes sees the imports above used
    "BREAK_MODES", "BaseDataset", "ByteTokenizer", "CountingIterator", "Dictionary",
    "DocumentToSequenceDataset", "EpochBatchIterator", "HuggingFaceTokenizer", "JsonlDataset",
    "JsonlSplit", "SPECIAL_SYMBOLS", "build_demo_corpus", "build_tokenizer", "collate_blocks",
    "default_demo_dir", "document_blocks", "iterators", "list_splits", "shard_dirs",
    "unigram_entropy",
]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULE_OF[name] or name}")
    value = module if _MODULE_OF[name] is None else getattr(module, name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
