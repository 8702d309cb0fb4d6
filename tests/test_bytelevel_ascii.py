"""The ASCII fast path of byte-level BPE gives exactly the ids of `tokenizers`' own encoding."""

import json
import random
import string

import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer

import metaseq_ds.data.bytelevel_ascii as bytelevel_ascii
from metaseq_ds.data.bytelevel_ascii import AsciiByteLevelEncoder
from metaseq_ds.data.tokenizers import HuggingFaceTokenizer

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
# What GPT-2's split regex treats differently: contractions (lower case only), letters, digits,
# punctuation runs, a space before each, runs of spaces before a word or at the end, and every
# ASCII whitespace and control character (\x1c-\x1f are spaces to Python, not to Unicode).
FRAGMENTS = (
    ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "''", "'", " '"]
    + list(string.ascii_letters) + list(string.digits) + list(string.punctuation)
    + [" ", "  ", "   ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\x00", "\x07", "\x7f"]
    + ["hello", " world", "Don't", "it's", "1999", " 42", "x1y2", "...", " !?", "_under_", "CamelCase"]
)


def random_texts(count: int, seed: int):
    rng = random.Random(seed)
    return ["".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def bpe():
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(random_texts(400, 0), vocab_size=600, min_frequency=2, show_progress=False, special_tokens=SPECIALS)
    return tokenizer


def reference(tokenizer, texts):
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


def test_ascii_texts_encode_exactly_as_the_tokenizer_does(bpe):
    wrapped = HuggingFaceTokenizer(bpe, "test")
    assert wrapped._ascii is not None
    texts = random_texts(3000, 1) + ["", " ", "  x", "x  ", "a\n\n b", "don't 've 'll", "  \t\n"]
    assert wrapped.encode_batch(texts) == reference(bpe, texts)
    assert len(wrapped._ascii.pieces) > 100  # the cache was used


def test_texts_it_does_not_handle_go_to_the_tokenizer_in_place(bpe):
    wrapped = HuggingFaceTokenizer(bpe, "test")
    texts = ["plain text", "caf\u00e9 na\u00efve \u00fcber", "a </s> inside", "<s>start", "after", "\u4e2d\u6587 and ascii"]
    handled = [wrapped._ascii.handles(text) for text in texts]
    assert handled == [True, False, False, False, True, False]
    assert wrapped.encode_batch(texts) == reference(bpe, texts)


def test_a_full_cache_starts_over_and_stays_exact(bpe, monkeypatch):
    monkeypatch.setattr(bytelevel_ascii, "MAX_CACHED_PIECES", 50)
    wrapped = HuggingFaceTokenizer(bpe, "test")
    texts = random_texts(500, 2)
    assert wrapped.encode_batch(texts) == reference(bpe, texts)
    assert len(wrapped._ascii.pieces) <= 50 + max(len(set(bytelevel_ascii.GPT2_SPLIT_ASCII.findall(t))) for t in texts)


def with_config(bpe, change):
    config = json.loads(bpe._tokenizer.to_str())
    change(config)
    return Tokenizer.from_str(json.dumps(config))


@pytest.mark.parametrize("change", [
    lambda c: c.update(normalizer={"type": "Lowercase"}),
    lambda c: c["pre_tokenizer"].update(add_prefix_space=True),
    lambda c: c["pre_tokenizer"].update(use_regex=False),
    lambda c: c["model"].update(dropout=0.1),
    lambda c: c.update(pre_tokenizer={"type": "Whitespace"}),
], ids=["normalizer", "prefix_space", "no_regex", "dropout", "other_pre_tokenizer"])
def test_tokenizers_it_would_not_reproduce_are_left_to_the_library(bpe, change):
    tokenizer = with_config(bpe, change)
    assert AsciiByteLevelEncoder.for_tokenizer(tokenizer) is None
    wrapped = HuggingFaceTokenizer(tokenizer, "test")
    texts = random_texts(50, 3)
    if tokenizer.model.dropout is None:  # with dropout no two encodings need agree
        assert wrapped.encode_batch(texts) == reference(tokenizer, texts)


def test_a_disagreement_with_the_tokenizer_stops_rather_than_misencodes(bpe, monkeypatch):
    wrong = HuggingFaceTokenizer(bpe, "test")
    monkeypatch.setattr(bytelevel_ascii, "GPT2_SPLIT_ASCII", bytelevel_ascii.re.compile(r"\S+|\s+"))  # not GPT-2's split
    with pytest.raises(RuntimeError, match="bug in metaseq_ds.data.bytelevel_ascii"):
        wrong.encode_batch(["it's 42 apples,  said he"])
