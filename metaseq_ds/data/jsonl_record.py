"""One jsonl line -> the document it holds: shared by the lazy reader (`jsonl`) and the token
store's builder. Imports no torch, so that tokenizing worker processes start fast."""

import json


class MalformedLine(ValueError):
    """A jsonl line that holds no document; the message says why (the caller names file:line)."""


def document_text(line: bytes) -> str:
    """The "text" field of one jsonl line."""
    try:
        record = json.loads(line)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise MalformedLine(f"not a JSON object ({str(error).splitlines()[0]})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise MalformedLine('needs a JSON object with a "text" string field')
    return record["text"]
