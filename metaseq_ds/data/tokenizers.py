"""Text <-> token ids: the byte tokenizer (needs no files) and GPT-2 byte BPE (metaseq's).

All tokenizers share one small interface: `encode(text) -> List[int]`, `encode_batch(texts)`,
`decode(ids) -> str`, `vocab_size`, `token_to_id(symbol)`, `id_to_token(id)`, `fingerprint()`
(what a token store records, so that ids from another tokenizer are never misread); and all
put `<s>`, `<pad>`, `</s>`, `<unk>` at ids 0..3, as OPT's vocabulary does. `build_tokenizer` picks one from the task's
flags: `--hf-tokenizer` > `--vocab-filename` + `--merges-filename` > the byte tokenizer.
"""

import functools
import hashlib
from pathlib import Path
from typing import List, Optional, Sequence

from metaseq_ds.data.bytelevel_ascii import AsciiByteLevelEncoder
from metaseq_ds.data.dictionary import SPECIAL_SYMBOLS
from metaseq_ds.errors import UsageError

# metaseq accepted upper-case spellings of the specials in older vocabularies.
_SPECIAL_SPELLINGS = [{"<s>", "<BOS>"}, {"<pad>", "<PAD>"}, {"</s>", "<EOS>"}, {"<unk>", "<UNK>"}]


class ByteTokenizer:
    """UTF-8 bytes as tokens: byte b is id 4 + b, after the four specials.

    With it, a language model's loss in bits per token is bits per byte (plus one end-of-
    document token per document), which makes small demo runs easy to judge.
    """

    offset = len(SPECIAL_SYMBOLS)
    vocab_size = offset + 256

    def encode(self, text: str) -> List[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(text) for text in texts]

    def fingerprint(self) -> str:
        return f"bytes+{self.offset}"

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def token_to_id(self, symbol: str) -> Optional[int]:
        if symbol in SPECIAL_SYMBOLS:
            return SPECIAL_SYMBOLS.index(symbol)
        if len(symbol) == 6 and symbol.startswith("<0x") and symbol.endswith(">"):
            return self.offset + int(symbol[3:5], 16)
        return None

    def id_to_token(self, idx: int) -> Optional[str]:
        if 0 <= idx < self.offset:
            return SPECIAL_SYMBOLS[idx]
        if idx < self.vocab_size:
            return f"<0x{idx - self.offset:02X}>"
        return None


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer (GPT-2 byte BPE or any tokenizer.json) behind our interface.

    Documents are encoded without the tokenizer's post-processor specials (some
    tokenizer.json files add a BOS): a document is its tokens plus the end-of-document id.
    """

    def __init__(self, tokenizer, source: str):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self._fingerprint: Optional[str] = None
        for idx, spellings in enumerate(_SPECIAL_SPELLINGS):
            found = tokenizer.id_to_token(idx)
            if found not in spellings:
                raise UsageError(
                    f"{source}: id {idx} must be {SPECIAL_SYMBOLS[idx]!r} (ids 0-3 are <s> <pad> </s> <unk>, "
                    f"as in OPT's vocabulary), found {found!r}"
                )

    def encode(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _ascii(self) -> Optional[AsciiByteLevelEncoder]:
        """The exact ASCII fast path where this tokenizer allows it: looked up on the first batch
        (reading the config serializes the whole tokenizer, ~70 ms for GPT-2's), so loading a
        tokenizer to generate or serve costs nothing more."""
        return AsciiByteLevelEncoder.for_tokenizer(self.tokenizer)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """`encode` of each text: ASCII texts of a GPT-2 style byte BPE by the exact fast path
        (`bytelevel_ascii`), the others by the Rust library, which spreads a batch over its
        threads (TOKENIZERS_PARALLELISM=false keeps it on one)."""
        encoded = self._ascii.encode_batch(texts) if self._ascii is not None else [None] * len(texts)
        rest = [i for i, ids in enumerate(encoded) if ids is None]
        if rest:
            encodings = self.tokenizer.encode_batch([texts[i] for i in rest], add_special_tokens=False)
            for i, encoding in zip(rest, encodings):
                encoded[i] = encoding.ids
        return encoded

    def fingerprint(self) -> str:
        """A hash of the whole serialized tokenizer: vocabulary, merges, normalizer, pre-tokenizer."""
        if self._fingerprint is None:
            self._fingerprint = "sha256:" + hashlib.sha256(self.tokenizer.to_str().encode("utf-8")).hexdigest()
        return self._fingerprint

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.vocab_size], skip_special_tokens=True)

    def token_to_id(self, symbol: str) -> Optional[int]:
        return self.tokenizer.token_to_id(symbol)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.tokenizer.id_to_token(idx)


def build_tokenizer(hf_tokenizer: Optional[str], vocab_filename: Optional[str], merges_filename: Optional[str]):
    """The tokenizer the task flags name (empty strings, as in metaseq configs, mean unset)."""
    if hf_tokenizer:
        from tokenizers import Tokenizer

        path = _existing_file("--hf-tokenizer", hf_tokenizer)
        return HuggingFaceTokenizer(_load("--hf-tokenizer", path, Tokenizer.from_file, str(path)), f"--hf-tokenizer {path}")
    if vocab_filename or merges_filename:
        if not merges_filename:
            raise UsageError(f"--vocab-filename {vocab_filename} needs --merges-filename (the GPT-2 BPE merges.txt)")
        if not vocab_filename:
            raise UsageError(f"--merges-filename {merges_filename} needs --vocab-filename (the GPT-2 BPE vocab.json)")
        from tokenizers import ByteLevelBPETokenizer

        vocab = _existing_file("--vocab-filename", vocab_filename)
        merges = _existing_file("--merges-filename", merges_filename)
        bpe = _load("--vocab-filename/--merges-filename", vocab, ByteLevelBPETokenizer.from_file, str(vocab), str(merges))
        return HuggingFaceTokenizer(bpe, f"--vocab-filename {vocab}")
    return ByteTokenizer()


def _existing_file(flag: str, name: str) -> Path:
    path = Path(name)
    if not path.is_file():
        raise UsageError(f"{flag}: file {path} does not exist")
    return path


def _load(flag: str, path: Path, loader, *args):
    try:
        return loader(*args)
    except Exception as error:  # tokenizers raises plain Exception subclasses for unreadable files
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"{flag}: cannot load {path}: {first_line}") from None
