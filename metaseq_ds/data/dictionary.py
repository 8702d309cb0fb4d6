"""`Dictionary`: the id <-> symbol table that models size their embeddings by.

The API is fairseq's (`pad()`, `eos()`, `index(sym)`, `len(d)`, `pad_to_multiple_`), so plugin
code keeps working. The four special symbols have OPT's fixed ids, and the table is padded
with made-up words to a multiple of 8, as metaseq does: GPT-2 BPE's 50265 symbols become
OPT's 50272.
"""

from typing import Dict, Iterable, List

SPECIAL_SYMBOLS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0, 1, 2, 3


class Dictionary:
    """Symbols in id order; the first four are `<s>`, `<pad>`, `</s>` (end of document), `<unk>`."""

    def __init__(self, symbols: Iterable[str] = ()):
        self.symbols: List[str] = []
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

    def add_symbol(self, symbol: str) -> int:
        if symbol not in self.indices:
            self.indices[symbol] = len(self.symbols)
            self.symbols.append(symbol)
        return self.indices[symbol]

    def pad_to_multiple_(self, padding_factor: int) -> None:
        """Append `madeupwordNNNN` symbols until the length is a multiple of `padding_factor`."""
        extra = 0
        while len(self.symbols) % padding_factor != 0:
            self.add_symbol(f"madeupword{extra:04d}")
            extra += 1

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
