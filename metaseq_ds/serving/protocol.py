"""OpenAI's completions API as data: a request body -> `CompletionRequest`, results -> response
dicts and stream chunks, bad input -> `RequestError` (an HTTP status and one line naming the field).

A request's body is a JSON object. Its generation fields are `GenerationOptions` fields under
their own names, so OpenAI's `max_tokens`, `temperature`, `top_p`, `n`, `best_of`, `logprobs`,
`echo`, `stop`, `seed` and the extensions `min_tokens`, `top_k`, `length_penalty` are checked
where `mseq generate`'s flags are, and a bad value is reported by its JSON name. The other fields:
`prompt` (a string, a list of strings, a list of token ids or a list of token-id lists), `model`
(one model is served: any name is accepted), `stream`, `user` (accepted, unused). A null value
means the default, as in OpenAI's API. Imports pydantic only.
"""

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr, ValidationError

from metaseq_ds.generation_options import GenerationOptions, OptionError

Prompt = Union[str, List[int]]

REQUEST_FIELDS = ("prompt", "model", "stream", "user")
OPTION_FIELDS = tuple(GenerationOptions.model_fields)
# OpenAI fields this server does not implement: named as such rather than as unknown.
UNSUPPORTED_FIELDS = ("suffix", "logit_bias", "presence_penalty", "frequency_penalty", "stream_options")
PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"
# metaseq's finish reasons -> OpenAI's: the model's end-of-document token is a natural stop.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class RequestError(Exception):
    """A request the server refuses: `status` (4xx), a one-line message, the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # such as a 429's Retry-After

    def body(self) -> Dict[str, Any]:
        """OpenAI's error object (what its client reads the message from)."""
        return error_body(self.message, self.param, self.code)


def error_body(message: str, param: Optional[str] = None, code: Optional[str] = None,
               kind: str = "invalid_request_error") -> Dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _RequestFields(BaseModel):
    """The fields of a completion request that are not generation options, typed as JSON gives them."""

    model_config = ConfigDict(extra="forbid")

    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    model: Optional[StrictStr] = None
    stream: StrictBool = False
    user: Optional[StrictStr] = None


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed request: `prompts` one or more (text, or token ids), `logprobs`: whether the
    response carries logprobs objects (the request's `logprobs` was a number, 0 included)."""

    prompts: List[Prompt]
    options: GenerationOptions
    stream: bool
    logprobs: bool
    model: Optional[str]


def json_object(body: bytes) -> Dict[str, Any]:
    """The JSON object a request body must be, or `RequestError` (400)."""
    try:
        data = json.loads(body)
    except ValueError as error:
        raise RequestError(400, f"the request body is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The request in `body`, or `RequestError` (400) naming the first bad field."""
    data = json_object(body)
    for key in data:
        if key in UNSUPPORTED_FIELDS:
            raise RequestError(400, f"{key} is not supported by this server", key)
        if key not in REQUEST_FIELDS and key not in OPTION_FIELDS:
            raise RequestError(400, f"unknown field {key!r}; a completion request takes "
                                    f"{', '.join(REQUEST_FIELDS + OPTION_FIELDS)}", key)
    if data.get("prompt") is None:
        raise RequestError(400, "prompt is required", "prompt")
    try:
        options = GenerationOptions.from_values({k: v for k, v in data.items() if k in OPTION_FIELDS and v is not None})
    except OptionError as error:
        raise RequestError(400, str(error), error.field) from None
    try:
        fields = _RequestFields.model_validate({k: v for k, v in data.items() if k in REQUEST_FIELDS and v is not None})
    except ValidationError as error:
        raise _field_error(error) from None
    prompts = [fields.prompt] if isinstance(fields.prompt, str) or _is_token_list(fields.prompt) else fields.prompt
    if not prompts:
        raise RequestError(400, "prompt is an empty list: give at least one prompt", "prompt")
    return CompletionRequest(prompts=list(prompts), options=options, stream=fields.stream,
                             logprobs=data.get("logprobs") is not None, model=fields.model)


def _is_token_list(prompt: list) -> bool:
    return bool(prompt) and all(isinstance(item, int) for item in prompt)


def _field_error(error: ValidationError) -> RequestError:
    problem = error.errors()[0]
    field = str(problem["loc"][0])
    if field == "prompt":
        return RequestError(400, f"prompt must be {PROMPT_SHAPES}", field)
    return RequestError(400, f"{field}: {problem['msg'][0].lower()}{problem['msg'][1:]}, got {problem['input']!r}", field)


def choice(index: int, result: Dict[str, Any], logprobs: bool) -> Dict[str, Any]:
    """One OpenAI choice from one of `GeneratorInterface.generate`'s result dicts."""
    return {
        "text": result["text"],
        "index": index,
        "logprobs": logprobs_object(result) if logprobs else None,
        "finish_reason": FINISH_REASONS[result["finish_reason"]],
    }


def logprobs_object(result: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI's logprobs: the tokens' text, their log-probabilities (null for an echoed first
    prompt token), the top tokens (null without `logprobs` > 0) and each token's offset in the text."""
    return {
        "tokens": result["tokens"],
        "token_logprobs": result["token_scores"],
        "top_logprobs": result["top_logprobs"],
        "text_offset": result["text_offset"],
    }


def completion(meta: Dict[str, Any], choices: List[Dict[str, Any]], prompt_tokens: int,
               completion_tokens: int) -> Dict[str, Any]:
    """The response to a request that does not stream. `meta`: id, object, created, model."""
    return {**meta, "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                                  "completion_tokens": completion_tokens,
                                                  "total_tokens": prompt_tokens + completion_tokens}}


def chunk(meta: Dict[str, Any], index: int, text: str, logprobs: Optional[Dict[str, Any]] = None,
          finish_reason: Optional[str] = None) -> str:
    """One server-sent event of a streamed completion: a piece of choice `index`."""
    body = {**meta, "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}]}
    return event(body)


def event(body: Union[Dict[str, Any], str]) -> str:
    """A server-sent event as OpenAI sends them: `data: <json>` and a blank line."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


DONE = event("[DONE]")
