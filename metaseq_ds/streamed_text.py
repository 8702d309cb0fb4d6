"""`StreamedText`: a completion's text as its tokens arrive, released only where it can no
longer change; `mseq generate`'s interactive prompt prints it, `mseq serve` streams it.

The final text of a completion (`GeneratorInterface`'s result) drops special tokens and ends
before the first stop string in the completion. So text is held back while its end could still
be the start of a stop string or is half of a multi-byte character, and nothing from a stop
string on is ever released. What was released is then always the start of the final text, and
`rest(final_text)` is the remainder, sent once the completion is done:

    text = StreamedText(tokenizer.decode, special_ids, stop_strings=["\\n\\n"])
    for token in tokens_as_they_come:
        send(text.push(token))  # often "", never more than is certain
    send(text.rest(result["text"]))
"""

from typing import Callable, Collection, List, Sequence

# What a UTF-8 decoder with errors="replace" ends with while a character's bytes are incomplete.
REPLACEMENT = "\ufffd"


class StreamedText:
    """The text of one completion. `prompt`: the prompt's token ids when the completion includes
    it (echo); stop strings are looked for after it only, as in the final text."""

    def __init__(self, decode: Callable[[List[int]], str], specials: Collection[int], stop_strings: Sequence[str],
                 prompt: Sequence[int] = ()):
        self.decode = decode
        self.specials = set(specials)
        self.stop_strings = list(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.tokens = [t for t in prompt if t not in self.specials]
        self.completion_start = len(decode(self.tokens))
        self.released = 0

    def push(self, token: int) -> str:
        """Add a new token; returns the text it makes certain (may be empty)."""
        if token not in self.specials:
            self.tokens.append(token)
        text = self.decode(self.tokens)
        ready = len(text) - self.hold
        if text.endswith(REPLACEMENT):
            ready = min(ready, len(text) - 1)
        for stop in self.stop_strings:
            found = text.find(stop, self.completion_start)
            if found >= 0:
                ready = min(ready, found)
        if ready <= self.released:
            return ""
        delta, self.released = text[self.released:ready], ready
        return delta

    def rest(self, final_text: str) -> str:
        """The part of the completion's final text not released yet."""
        return final_text[self.released:]
