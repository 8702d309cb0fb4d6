"""Data: dictionary, tokenizers, metaseq's jsonl layout, break modes and the batch iterator.

metaseq code imports `Dictionary`, `BaseDataset` (fairseq's `FairseqDataset`), `JsonlDataset`,
`DocumentToSequenceDataset` and `iterators` from here.
"""

from metaseq_ds.data import iterators
from metaseq_ds.data.base_dataset import BaseDataset
from metaseq_ds.data.demo_corpus import build_demo_corpus, default_demo_dir, unigram_entropy
from metaseq_ds.data.dictionary import SPECIAL_SYMBOLS, Dictionary
from metaseq_ds.data.document_blocks import BREAK_MODES, DocumentToSequenceDataset, collate_blocks, document_blocks
from metaseq_ds.data.iterators import CountingIterator, EpochBatchIterator
from metaseq_ds.data.jsonl import JsonlDataset, JsonlSplit, list_splits, shard_dirs
from metaseq_ds.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, build_tokenizer

__all__ = [
    "BREAK_MODES",
    "BaseDataset",
    "ByteTokenizer",
    "CountingIterator",
    "Dictionary",
    "DocumentToSequenceDataset",
    "EpochBatchIterator",
    "HuggingFaceTokenizer",
    "JsonlDataset",
    "JsonlSplit",
    "SPECIAL_SYMBOLS",
    "build_demo_corpus",
    "build_tokenizer",
    "collate_blocks",
    "default_demo_dir",
    "document_blocks",
    "iterators",
    "list_splits",
    "shard_dirs",
    "unigram_entropy",
]
