"""Data: dictionary, tokenizers, metaseq's jsonl layout, break modes, token stores and the batch iterator.

metaseq code imports `Dictionary`, `BaseDataset` (fairseq's `FairseqDataset`), `JsonlDataset`,
`DocumentToSequenceDataset` and `iterators` from here.

The names below are imported on first use (PEP 562), so that importing one submodule does not
import torch: the token store's tokenizing worker processes import only
`metaseq_ds.data.store_builder` and `metaseq_ds.data.tokenizers`, and start in a fraction of
a second instead of the seconds torch takes.
"""

import importlib

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

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_MODULE_OF[name] or name}")
    value = module if _MODULE_OF[name] is None else getattr(module, name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
