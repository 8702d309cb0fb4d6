"""GPT-2 byte-level BPE of ASCII documents: the ids `tokenizers` gives, about 2x faster a core.

Encoding with a byte-level BPE spends ~90% of its time in the pre-tokenizer: GPT-2's split
regex, run by Oniguruma inside `tokenizers` (~3 MB/s a core here). On ASCII text the regex's
Unicode classes are ASCII ones (\\p{L} = [A-Za-z], \\p{N} = [0-9], \\s = [\\t\\n\\v\\f\\r ]), which
Python's `re` runs several times faster with the same leftmost, ordered-alternation semantics;
and the BPE of each distinct piece is asked of the tokenizer itself once, then cached. A token
store is built once per corpus, so this is where its build spends its time.

It applies only where the result is the tokenizer's own: no normalizer, a ByteLevel
pre-tokenizer with the regex and no prefix space, a BPE model without dropout, no truncation or
padding; and per document, ASCII text holding none of the added tokens' contents (those are
split out before pre-tokenization). Everything else goes to the tokenizer's `encode_batch`.
Each piece's encoding is checked to be one pre-tokenizer word, and the first document of each
batch is compared with the tokenizer's own encoding: a mismatch is a bug, and stops the build.
"""

import itertools
import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

_SPACE = "\\t\\n\\x0b\\x0c\\r "
# tokenizers' ByteLevel regex, 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+,
# with its classes restricted to ASCII.
GPT2_SPLIT_ASCII = re.compile(
    f"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^{_SPACE}A-Za-z0-9]+|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+"
)
# Distinct pieces kept (words, numbers, runs of punctuation or spaces): bounded for corpora of
# URLs and hashes; the cache starts over when full.
MAX_CACHED_PIECES = 1 << 20


class AsciiByteLevelEncoder:
    """Encodes the texts it `handles` by GPT2_SPLIT_ASCII and a cache of each piece's ids."""

    def __init__(self, tokenizer, added_contents: Sequence[str]):
        self.tokenizer = tokenizer
        self.added_contents = [content for content in added_contents if content]
        self.pieces: Dict[str, Tuple[int, ...]] = {}

    def __getstate__(self):  # a worker process starts with an empty cache rather than a copy
        return {**self.__dict__, "pieces": {}}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Optional["AsciiByteLevelEncoder"]:
        """The fast path for a `tokenizers` tokenizer, or None where it would not be exact."""
        config = json.loads(tokenizer.to_str())
        pre = config.get("pre_tokenizer") or {}
        model = config.get("model") or {}
        exact = (
            config.get("normalizer") is None
            and config.get("truncation") is None
            and config.get("padding") is None
            and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
            and model.get("type") == "BPE"
            and model.get("dropout") is None
        )
        return cls(tokenizer, [token["content"] for token in config.get("added_tokens", [])]) if exact else None

    def handles(self, text: str) -> bool:
        return text.isascii() and not any(content in text for content in self.added_contents)

    def encode_batch(self, texts: Sequence[str]) -> List[Optional[List[int]]]:
        """Each text's ids, or None for the texts this path does not handle."""
        encoded = [self._encode(text) if self.handles(text) else None for text in texts]
        first = next((i for i, ids in enumerate(encoded) if ids is not None), None)
        if first is not None and encoded[first] != self.tokenizer.encode(texts[first], add_special_tokens=False).ids:
            raise RuntimeError(f"the ASCII byte-level fast path disagrees with the tokenizer on {texts[first][:80]!r}: "
                               "this is a bug in metaseq_ds.data.bytelevel_ascii, please report it")
        return encoded

    def _encode(self, text: str) -> List[int]:
        pieces = GPT2_SPLIT_ASCII.findall(text)
        try:
            return list(itertools.chain.from_iterable(map(self.pieces.__getitem__, pieces)))
        except KeyError:  # a piece not seen yet: learn this text's new pieces, then look up again
            self._learn(pieces)
            return list(itertools.chain.from_iterable(map(self.pieces.__getitem__, pieces)))

    def _learn(self, pieces: List[str]) -> None:
        """Cache the encodings of `pieces` (all of them present afterwards). One `encode` call a
        piece: a batch call per text would wake the library's thread pool for a few words."""
        new = {piece for piece in pieces if piece not in self.pieces}
        if len(self.pieces) + len(new) > MAX_CACHED_PIECES:
            self.pieces.clear()
            new = set(pieces)
        for piece in new:
            encoding = self.tokenizer.encode(piece, add_special_tokens=False)
            if any(word != 0 for word in encoding.word_ids):
                raise RuntimeError(f"the ASCII byte-level fast path split {piece!r} where the tokenizer does not: "
                                   "this is a bug in metaseq_ds.data.bytelevel_ascii, please report it")
            self.pieces[piece] = tuple(encoding.ids)
