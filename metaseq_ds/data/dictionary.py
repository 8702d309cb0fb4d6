"""`Dictionary`: the id <-> symbol table that models size their embeddings by.

The API is fairseq's (`pad()`, `eos()`, `index(sym)`, `len(d)`, `pad_to_multiple_`, and the
`dict.txt` files of `load` / `save`, built from text by `add_file_to_dictionary` + `finalize`),
so plugin code keeps working. The four special symbols have OPT's fixed ids, and the table is
padded with made-up words to a multiple of 8, as metaseq does: GPT-2 BPE's 50265 symbols
become OPT's 50272.
"""

import multiprocessing
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import IO, Callable, Dict, Iterable, List, Union

from metaseq_ds.errors import UsageError

SPECIAL_SYMBOLS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0, 1, 2, 3
# A dict.txt line ending in one of these replaces an earlier entry of its symbol (fairseq's, metaseq's).
OVERWRITE_FLAGS = ("#fairseq:overwrite", "#metaseq:overwrite")


class Dictionary:
    """Symbols in id order; the first four are `<s>`, `<pad>`, `</s>` (end of document), `<unk>`.

    `count[i]` is how often symbol i was seen (what `finalize` sorts by; 0 for padding words)."""

    def __init__(self, symbols: Iterable[str] = ()):
        self.symbols: List[str] = []
        self.count: List[int] = []
        self.indices: Dict[str, int] = {}
        for symbol in SPECIAL_SYMBOLS:
            self.add_symbol(symbol)
        self.bos_index, self.pad_index, self.eos_index, self.unk_index = range(len(SPECIAL_SYMBOLS))
        self.nspecial = len(SPECIAL_SYMBOLS)
        for symbol in symbols:
            self.add_symbol(symbol)

    @classmethod
    def of_size(cls, size: int) -> "Dictionary":
        """The special symbols padded to `size` entries: what a model of that vocabulary needs
        when no tokenizer is at hand (weight checks, converted checkpoints, tests)."""
        dictionary = cls()
        dictionary.pad_to_multiple_(size)
        return dictionary

    def add_symbol(self, symbol: str, n: int = 1, overwrite: bool = False) -> int:
        """The id of `symbol`, added if new; `n` more sightings are counted. With `overwrite` a
        known symbol gets a new id (fairseq's semantics: the old id keeps its entry)."""
        if symbol in self.indices and not overwrite:
            self.count[self.indices[symbol]] += n
            return self.indices[symbol]
        self.indices[symbol] = len(self.symbols)
        self.symbols.append(symbol)
        self.count.append(n)
        return self.indices[symbol]

    def pad_to_multiple_(self, padding_factor: int) -> None:
        """Append `madeupwordNNNN` symbols until the length is a multiple of `padding_factor`."""
        extra = 0
        while len(self.symbols) % padding_factor != 0:
            self.add_symbol(f"madeupword{extra:04d}", n=0)
            extra += 1

    def finalize(self, threshold: int = -1, nwords: int = -1, padding_factor: int = 8) -> None:
        """fairseq's: keep the specials, then the other symbols by count, most frequent first
        (ties in symbol order), at most `nwords` symbols in all (specials included; <= 0: all)
        and only those seen at least `threshold` times; then pad to `padding_factor`."""
        if nwords <= 0:
            nwords = len(self)
        counts = Counter(dict(sorted(zip(self.symbols[self.nspecial:], self.count[self.nspecial:]))))
        kept = [(s, c) for s, c in counts.most_common(nwords - self.nspecial) if c >= threshold]
        self.symbols = self.symbols[:self.nspecial] + [s for s, _ in kept]
        self.count = self.count[:self.nspecial] + [c for _, c in kept]
        self.indices = {symbol: index for index, symbol in enumerate(self.symbols)}
        self.pad_to_multiple_(padding_factor)

    @classmethod
    def load(cls, f: Union[str, Path, IO[str]]) -> "Dictionary":
        """A dictionary from a fairseq `dict.txt`: one `<symbol> <count>` line per symbol after
        the specials (which the file leaves out)."""
        dictionary = cls()
        dictionary.add_from_file(f)
        return dictionary

    def add_from_file(self, f: Union[str, Path, IO[str]]) -> None:
        """Add the symbols and counts of a `dict.txt` (a path or an open text file)."""
        if isinstance(f, (str, Path)):
            with open(f, encoding="utf-8") as lines:
                self.add_from_file(lines)
            return
        source = getattr(f, "name", "the dictionary file")
        for number, line in enumerate(f, 1):
            symbol, _, count = line.rstrip().rpartition(" ")
            overwrite = count in OVERWRITE_FLAGS
            if overwrite:
                symbol, _, count = symbol.rpartition(" ")
            if not symbol or not count.isdigit():
                raise UsageError(f"{source}: line {number}: expected '<symbol> <count> [{OVERWRITE_FLAGS[0]}]', "
                                 f"got {line.rstrip()!r}")
            if symbol in self.indices and not overwrite:
                raise UsageError(f"{source}: line {number}: duplicate symbol {symbol!r} "
                                 f"(end the line with {OVERWRITE_FLAGS[0]} to replace the earlier one)")
            self.add_symbol(symbol, n=int(count), overwrite=overwrite)

    def save(self, f: Union[str, Path, IO[str]]) -> None:
        """Write the `dict.txt` that `load` reads (the specials are implied, as in fairseq's)."""
        if isinstance(f, (str, Path)):
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            with open(f, "w", encoding="utf-8") as out:
                self.save(out)
            return
        for symbol, count in zip(self.symbols[self.nspecial:], self.count[self.nspecial:]):
            f.write(f"{symbol} {count}\n")

    @staticmethod
    def add_file_to_dictionary(filename: Union[str, Path], dictionary: "Dictionary",
                               tokenize: Callable[[str], List[str]] = str.split, num_workers: int = 1) -> None:
        """Count the words (`tokenize` of each line) of a text file into `dictionary`, plus one end
        of sentence per line, as fairseq does; `num_workers` processes count parts of the file
        (then `tokenize` must be a module-level function, which they import)."""
        for word, count in sorted(count_words(filename, tokenize, num_workers).items()):
            dictionary.add_symbol(word, n=count)

    def __len__(self) -> int:
        return len(self.symbols)

    def __getitem__(self, idx: int) -> str:
        return self.symbols[idx] if 0 <= idx < len(self.symbols) else SPECIAL_SYMBOLS[3]

    def __contains__(self, symbol: str) -> bool:
        return symbol in self.indices

    def index(self, symbol: str) -> int:
        return self.indices.get(symbol, self.unk_index)

    def bos(self) -> int:
        return self.bos_index

    def pad(self) -> int:
        return self.pad_index

    def eos(self) -> int:
        return self.eos_index

    def unk(self) -> int:
        return self.unk_index

    def string(self, ids, separator: str = " ") -> str:
        """The symbols of `ids` (a list or 1-D tensor) without padding, joined by `separator`."""
        if hasattr(ids, "tolist"):  # a tensor (this module does not import torch: see data/__init__.py)
            ids = ids.tolist()
        return separator.join(self[i] for i in ids if i != self.pad_index)


def count_words(filename: Union[str, Path], tokenize: Callable[[str], List[str]] = str.split, workers: int = 1) -> Counter:
    """How often each word (`tokenize` of a line) occurs in a text file, and `</s>` once per line;
    `workers` processes each count a line-aligned byte range."""
    starts = _line_starts(Path(filename), max(1, workers))
    ranges = list(zip(starts, starts[1:]))
    if len(ranges) == 1:
        return _count_range(filename, tokenize, *ranges[0])
    # forkserver: this process may run threads (torch's), which a forked child would inherit locked.
    with ProcessPoolExecutor(len(ranges), mp_context=multiprocessing.get_context("forkserver")) as pool:
        parts = pool.map(_count_range, *zip(*[(filename, tokenize, start, end) for start, end in ranges]))
        return sum(parts, Counter())


def _line_starts(path: Path, parts: int) -> List[int]:
    """Byte offsets that cut the file into at most `parts` ranges of whole lines (the first 0, the
    last the file's size)."""
    size = path.stat().st_size
    starts = [0]
    with open(path, "rb") as f:
        for part in range(1, parts):
            f.seek(max(size * part // parts, starts[-1]))
            f.readline()  # to the start of the next line
            if starts[-1] < f.tell() < size:
                starts.append(f.tell())
    return starts + [size]


def _count_range(filename: Union[str, Path], tokenize: Callable[[str], List[str]], start: int, end: int) -> Counter:
    counts: Counter = Counter()
    with open(filename, "rb") as f:
        f.seek(start)
        while f.tell() < end:
            line = f.readline()
            counts.update(tokenize(line.decode("utf-8")))
            counts[SPECIAL_SYMBOLS[2]] += 1
    return counts
