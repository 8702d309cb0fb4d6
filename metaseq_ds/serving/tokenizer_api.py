"""vLLM's tokenizer routes for `mseq serve`, so that clients written for vLLM (lm-evaluation-
harness's `local-completions` with its remote tokenizer) count and split tokens as the model does:

    GET  /tokenizer_info   {"eos_token", "bos_token", "pad_token", "unk_token", "model_max_length", ...}
    POST /tokenize         {"prompt": str, "add_special_tokens": bool = true} -> {"tokens", "count", "max_model_len"}
    POST /detokenize       {"tokens": [int, ...]} -> {"prompt": str}

The text of a special token (`</s>`, `<s>`, `<pad>`, `<unk>`) stands for its id both ways, as
in the Hugging Face tokenizer `mseq export` writes: lm-eval finds the end-of-document id as
`tokenize(eos_token)[0]`, and a decoded prompt must read back as the same ids. Each function
takes the server's `GeneratorInterface` and a request body; bad input is `RequestError` (400)
naming the field.
"""

import re
from typing import Any, Dict, List, Optional, Type, TypeVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from metaseq_ds.serving.protocol import RequestError, json_object

Request = TypeVar("Request", bound=BaseModel)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: StrictStr
    add_special_tokens: StrictBool = True
    model: Optional[StrictStr] = None  # vLLM's clients send it; one model is served


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: List[StrictInt]
    model: Optional[StrictStr] = None


def info(interface) -> Dict[str, Any]:
    """The special tokens and the length limit, as vLLM's /tokenizer_info gives them.

    The beginning of a document is `</s>`, as in OPT's tokenizer and in training (documents are
    separated by it), not the dictionary's unused `<s>`: lm-eval's `prefix_token_id` is the BOS."""
    d = interface.dictionary
    return {"tokenizer_class": type(interface.tokenizer).__name__, "bos_token": d[d.eos()],
            "eos_token": d[d.eos()], "pad_token": d[d.pad()], "unk_token": d[d.unk()],
            "model_max_length": interface.max_positions(), "vocab_size": len(d)}


def tokenize(interface, body: bytes) -> Dict[str, Any]:
    """The prompt's ids: after the `</s>` that `mseq generate` and /v1/completions put before a
    text prompt with `add_special_tokens`, the tokenizer's ids alone without."""
    request = _parse(body, TokenizeRequest)
    tokens = _encode(interface, request.prompt)
    if request.add_special_tokens:
        tokens = [interface.dictionary.eos()] + tokens
    return {"tokens": tokens, "count": len(tokens), "max_model_len": interface.max_positions()}


def detokenize(interface, body: bytes) -> Dict[str, Any]:
    """The text of the ids, special tokens written as their text (Hugging Face's `decode`
    without `skip_special_tokens`), so that `tokenize` of it gives the ids back."""
    request = _parse(body, DetokenizeRequest)
    d = interface.dictionary
    bad = [t for t in request.tokens if not 0 <= t < len(d)]
    if bad:
        raise RequestError(400, f"tokens: token id {bad[0]} is outside the vocabulary (0..{len(d) - 1})", "tokens")
    specials = _specials(interface)
    pieces, run = [], []
    for token in request.tokens:
        if token in specials.values():
            pieces += [interface.tokenizer.decode(run), d[token]]
            run = []
        else:
            run.append(token)
    return {"prompt": "".join(pieces) + interface.tokenizer.decode(run)}


def _encode(interface, text: str) -> List[int]:
    """The tokenizer's ids of `text`, each special token's text as its id."""
    specials = _specials(interface)
    # Longest first, so that no special token's text is split at a shorter one inside it.
    pattern = "(" + "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)) + ")"
    ids: List[int] = []
    for index, piece in enumerate(re.split(pattern, text)):
        if index % 2:  # re.split puts the separators it found at the odd indices
            ids.append(specials[piece])
        elif piece:
            ids += interface.tokenizer.encode(piece)
    return ids


def _specials(interface) -> Dict[str, int]:
    d = interface.dictionary
    return {d[i]: i for i in (d.bos(), d.pad(), d.eos(), d.unk())}


def _parse(body: bytes, model: Type[Request]) -> Request:
    try:
        return model.model_validate(json_object(body))
    except ValidationError as error:
        problem = error.errors()[0]
        field = ".".join(str(part) for part in problem["loc"]) or None
        if problem["type"] == "extra_forbidden":
            message = f"unknown field {field!r}; this route takes {', '.join(model.model_fields)}"
        elif problem["type"] == "missing":
            message = f"{field} is required"
        else:
            message = f"{field}: {problem['msg'][0].lower()}{problem['msg'][1:]}, got {problem['input']!r}"
        raise RequestError(400, message, str(problem["loc"][0])) from None
