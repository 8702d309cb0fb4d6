"""StreamedText: streamed text is only ever the start of the final text, whatever a stop string
or a half-received multi-byte character does."""

from metaseq_ds.data.tokenizers import ByteTokenizer
from metaseq_ds.streamed_text import StreamedText

TOKENIZER = ByteTokenizer()
SPECIALS = {0, 1, 2, 3}


def _stream(text_bytes: bytes, stop_strings, prompt=()):
    streamed = StreamedText(TOKENIZER.decode, SPECIALS, stop_strings, prompt=prompt)
    pieces = [streamed.push(4 + b) for b in text_bytes]
    return streamed, pieces


def test_a_possible_stop_string_start_is_held_back_and_the_stop_string_never_sent():
    streamed, pieces = _stream(b"Hello wor", ["world"])
    assert "".join(pieces) == "Hello"  # " wor" could still begin "world"
    streamed, pieces = _stream(b"Hello world and more", ["world"])
    assert "".join(pieces) == "Hello "  # the final text ends before the stop string
    assert streamed.rest("Hello ") == ""


def test_half_a_character_waits_for_the_rest():
    euro = "€".encode()
    streamed, pieces = _stream(b"ab" + euro, [])
    assert pieces == ["a", "b", "", "", "€"]
    streamed, pieces = _stream(b"ab" + euro[:2], [])
    assert "".join(pieces) == "ab" and streamed.rest("ab\ufffd") == "\ufffd"


def test_echo_sends_the_prompt_first_and_looks_for_stops_after_it():
    prompt = [2] + [4 + b for b in b"stop here: "]
    streamed, pieces = _stream(b"go", ["stop"], prompt=prompt)
    assert "".join(pieces) + streamed.rest("stop here: go") == "stop here: go"
    assert pieces[0].startswith("stop here")  # the prompt's "stop" does not end the completion


def test_specials_are_not_text():
    streamed = StreamedText(TOKENIZER.decode, SPECIALS, [])
    assert [streamed.push(t) for t in (4 + ord("a"), 2, 4 + ord("b"))] == ["a", "", "b"]
