"""`mseq serve --path CKPT`: serve a checkpoint over HTTP with metaseq's hosted API, which is
OpenAI's completions API (`metaseq_ds.serving`).

    mseq serve --path checkpoints                      # http://127.0.0.1:6010
    mseq serve --path checkpoints --host 0.0.0.0 --api-key "$KEY" --max-batch-tokens 32768
    deepspeed --num_gpus 2 --module metaseq_ds.cli.serve --path CKPT   # the model split across 2 ranks

Loads the model as `mseq generate` does (`GeneratorInterface.load_model`: under a launcher each
rank keeps its tensor-parallel shard). Alone, requests are batched continuously
(`serving.continuous`: sequences join and leave the batch at every decoding step). Under a
launcher rank 0 listens and batches requests statically while the other ranks decode the
batches rank 0 broadcasts (`serving.runner`). Ctrl-C or SIGTERM stops rank 0 (uvicorn's
graceful shutdown: new connections are refused, requests in flight are answered), which then
tells the other ranks to stop; they ignore the signals themselves.
"""

import contextlib
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

from metaseq_ds.cli.guard import run_alone, run_guarded
from metaseq_ds.dataclass.constraints import describe_range
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import COMPILE_HELP
from metaseq_ds.serving.options import ServeOptions


def command(
    path: str = typer.Option(..., "--path", help="checkpoint: a save dir (its last checkpoint) or a checkpoint_* dir"),
    host: str = typer.Option(ServeOptions.host, "--host", help="address to listen on (0.0.0.0: every interface; give an --api-key then)"),
    port: int = typer.Option(ServeOptions.port, "--port",
                             help="TCP port (0: any free port; the address is printed)" + describe_range(ServeOptions, "port")),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="MSEQ_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every route but /health and /metrics"),
    max_batch_tokens: int = typer.Option(
        ServeOptions.max_batch_tokens, "--max-batch-tokens",
        help="KV-cache positions decoded at once: continuous batching allocates them at start-up, --max-model-len "
             "per sequence; static batching counts sequences x (longest prompt + most new tokens) per batch. "
             "Larger requests are refused" + describe_range(ServeOptions, "max_batch_tokens")),
    max_request_bytes: int = typer.Option(
        ServeOptions.max_request_bytes, "--max-request-bytes",
        help="refuse request bodies larger than this (HTTP 413)" + describe_range(ServeOptions, "max_request_bytes")),
    compile: Optional[bool] = typer.Option(None, "--compile/--no-compile", help=COMPILE_HELP),
    batching: str = typer.Option(
        ServeOptions.batching, "--batching",
        help="continuous: requests join and leave the batch at every decoding step; static: a batch decodes to its "
             "end before the next starts; one: one request at a time (static is what several ranks use)"),
    max_model_len: Optional[int] = typer.Option(
        None, "--max-model-len",
        help="positions per sequence, prompt and new tokens (default: the model's); fewer make room for more "
             "sequences in --max-batch-tokens"),
    max_queued_requests: int = typer.Option(
        ServeOptions.max_queued_requests, "--max-queued-requests",
        help="answer 429 (with Retry-After) while this many requests wait" + describe_range(ServeOptions, "max_queued_requests")),
    request_timeout: float = typer.Option(
        ServeOptions.request_timeout, "--request-timeout",
        help="seconds a request may take from arrival to its last token; then it stops with 504"
             + describe_range(ServeOptions, "request_timeout")),
) -> None:
    """Serve a checkpoint over HTTP: metaseq's hosted API, OpenAI-compatible completions, continuously batched."""
    run_guarded("serve", main, ServeOptions(path, host, port, api_key, max_batch_tokens, max_request_bytes, compile,
                                            batching, max_model_len, max_queued_requests, request_timeout))


def main(options: ServeOptions) -> None:
    options.validate()
    path, api_key = options.path, options.api_key
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s | %(name)s | %(message)s")
    rank, ranks = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if api_key == "":
        raise UsageError("--api-key is empty: give a key, or leave the flag out to serve without one")
    listener = bind(options.host, options.port) if rank == 0 else None  # before the model loads: a taken port fails fast
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout; stdout is for the address line
        from metaseq_ds.hub_utils import GeneratorInterface
        from metaseq_ds.serving.runner import ModelRunner

        interface = GeneratorInterface(path, compile=options.compile)
        interface.load_model()
    runner = ModelRunner(interface, ranks)
    if listener is None:
        # The other ranks stop when rank 0 says so, after the batch in flight (a launcher signals
        # every rank at once; one that left early would strand rank 0's collectives).
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, signal.SIG_IGN)
        runner.follow()
        return
    try:
        serve(interface, runner, listener, Path(path).resolve().name, options)
    finally:
        runner.stop()


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening yet: connections are refused until the model is loaded)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as error:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error})") from None
    return listener


def serve(interface, runner, listener: socket.socket, model_name: str, options: ServeOptions) -> None:
    """Serve on `listener` until a signal stops uvicorn; then finish the batch being decoded."""
    import uvicorn

    app, batcher = build_app(interface, runner, model_name, options)
    host, port = listener.getsockname()[:2]
    listener.listen(2048)  # from here connections queue until uvicorn accepts them: the address is usable
    print(f"mseq serve: {model_name} on http://{host}:{port} (POST /v1/completions; "
          f"{'API key required' if options.api_key else 'no API key'})", flush=True)
    # uvicorn stops gracefully on SIGINT and SIGTERM, then raises the signal again for the handler
    # that was there before: let that be a KeyboardInterrupt for both, so that the batcher still
    # finishes and the other ranks are told to stop.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=30)).run(sockets=[listener])
    except KeyboardInterrupt:
        pass
    finally:
        batcher.close()


def build_app(interface, runner, model_name: str, options: ServeOptions):
    """The FastAPI app and its running batcher (close it after the app stops): continuous
    batching alone, static batching as `options.batching` asks or under a launcher."""
    from metaseq_ds.serving.app import create_app
    from metaseq_ds.serving.batcher import Batcher
    from metaseq_ds.serving.completions import Completions
    from metaseq_ds.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    if options.batching == "continuous" and runner.ranks == 1:
        from metaseq_ds.serving.continuous import ContinuousBatcher

        batcher = ContinuousBatcher(interface, options.max_batch_tokens, options.max_model_len,
                                    options.max_queued_requests, metrics)
    else:
        if options.batching == "continuous":
            logging.getLogger("metaseq_ds.serving").warning(
                "continuous batching runs in one process for now: the %d ranks batch requests statically", runner.ranks)
        batcher = Batcher(runner, options.max_batch_tokens, one_at_a_time=options.batching == "one",
                          max_queued=options.max_queued_requests, metrics=metrics)
    completions = Completions(interface, batcher.start(), model_name, metrics, options.request_timeout)
    return create_app(completions, options.api_key, options.max_request_bytes, metrics), batcher


if __name__ == "__main__":
    run_alone("serve", command, sys.argv[1:])
