"""The HTTP side of `mseq serve`: a FastAPI app with metaseq's and OpenAI's completion routes.

    POST /completions, /v1/completions, /v1/engines/{engine}/completions   completions
    GET  /v1/models                                                        the one model served
    GET  /tokenizer_info, POST /tokenize, /detokenize                      vLLM's tokenizer routes
    GET  /metrics                                                          Prometheus metrics (`serving.metrics`)
    GET  /health                                                           liveness (never needs a key)

With an API key every route but `/health` and `/metrics` needs `Authorization: Bearer KEY` (compared in
constant time; 401 otherwise). Request bodies over `max_request_bytes` are refused (413) before
they are parsed. Every refusal is OpenAI's error object with a one-line message naming the field
(`{"error": {"message", "type", "param", "code"}}`), so the `openai` client raises it as the
matching `APIStatusError`; a fault of the server is a 500 with one line (the traceback goes to
the server's log), and the server goes on serving.
"""

import logging
import secrets
import time
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from metaseq_ds.serving import tokenizer_api
from metaseq_ds.serving.completions import Completions, ServerFault
from metaseq_ds.serving.protocol import RequestError, error_body, parse_completion_request

logger = logging.getLogger("metaseq_ds.serving")

COMPLETION_ROUTES = ("/completions", "/v1/completions", "/v1/engines/{engine}/completions")


def create_app(completions: Completions, api_key: Optional[str], max_request_bytes: int, metrics=None) -> FastAPI:
    app = FastAPI(title="mseq serve", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization")
        if given is None:
            raise RequestError(401, "no API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise RequestError(401, "wrong API key", code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": completions.model_name, "object": "model", "created": created,
                                            "owned_by": "metaseq-ds"}]}

    # vLLM's tokenizer routes: lm-eval's `local-completions` tokenizes through them.
    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        authorize(request)
        return tokenizer_api.info(completions.interface)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        authorize(request)
        return tokenizer_api.tokenize(completions.interface, await read_body(request, max_request_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        authorize(request)
        return tokenizer_api.detokenize(completions.interface, await read_body(request, max_request_bytes))

    async def complete(request: Request):
        authorize(request)
        parsed = parse_completion_request(await read_body(request, max_request_bytes))
        if parsed.stream:
            return StreamingResponse(completions.stream(parsed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def disconnected() -> None:  # the body is read: what comes next is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass

        answer = await completions.complete(parsed, disconnected)
        return answer if answer is not None else Response(status_code=499)  # nginx's "client closed request"

    for path in COMPLETION_ROUTES:
        app.add_api_route(path, complete, methods=["POST"])

    if metrics is not None:
        from metaseq_ds.serving.metrics import CONTENT_TYPE

        @app.get("/metrics")
        async def prometheus():  # no key, as /health: what scrapers expect (vLLM's is open too)
            return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def routing(request: Request, error: HTTPException):  # unknown route, wrong method
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(error_body(message), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ServerFault)
    async def fault(request: Request, error: ServerFault):
        return JSONResponse(error_body(str(error), kind="server_error"), status_code=error.status)

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        message = f"internal server error ({type(error).__name__}: {error})".replace("\n", " ")
        return JSONResponse(error_body(message, kind="server_error"), status_code=500)

    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes: as declared, or as it arrives."""
    declared = request.headers.get("content-length", "")
    too_large = RequestError(413, f"the request body is over {limit} bytes, this server's limit (--max-request-bytes)")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise too_large
    return bytes(body)
