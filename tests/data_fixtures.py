"""Tiny corpora and tokenizer files for the data and task tests (imported explicitly)."""

import json
from pathlib import Path
from typing import Dict, List

from metaseq_ds.dataclass import validate_config
from metaseq_ds.tasks import setup_task
from metaseq_ds.tasks.streaming_language_modeling import StreamingLanguageModelingConfig

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


def document(n: int) -> str:
    """A deterministic document of a length that varies with n (2 to 60 words)."""
    return " ".join(WORDS[(n * 7 + i * 3) % len(WORDS)] for i in range(2 + (n * 13) % 59)) + f" doc{n}"


def write_jsonl(path: Path, texts: List[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def write_corpus(root: Path, layout: Dict[str, List[int]]) -> Path:
    """`layout` maps a shard directory ("train/00", "valid/books/00") to its number of documents.

    Each shard gets two files (a.jsonl, b.jsonl) so that concatenation order is exercised;
    document numbers are unique across the corpus.
    """
    n = 0
    for shard, count in layout.items():
        texts = [document(n + i) for i in range(count)]
        n += count
        write_jsonl(root / shard / "a.jsonl", texts[: count // 2])
        write_jsonl(root / shard / "b.jsonl", texts[count // 2 :])
    return root


def make_task(data: Path, **values):
    cfg = validate_config(StreamingLanguageModelingConfig, {"data": str(data), "tokens_per_sample": 16, **values})
    return setup_task(cfg)


def train_bpe(directory: Path, special_tokens=("<s>", "<pad>", "</s>", "<unk>")):
    """A small GPT-2 style byte BPE saved as vocab.json/merges.txt and tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [document(i) for i in range(200)], vocab_size=400, min_frequency=2, show_progress=False, special_tokens=list(special_tokens)
    )
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = bpe.save_model(str(directory))
    bpe.save(str(directory / "tokenizer.json"))
    return Path(vocab), Path(merges), directory / "tokenizer.json"
