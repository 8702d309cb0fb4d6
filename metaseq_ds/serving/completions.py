"""`Completions`: a parsed request in, an OpenAI response (or its server-sent events) out.

Prompts are encoded as `mseq generate` encodes them (text after `</s>`, token ids as given) and
checked against the model and the server's limits before anything is queued: a prompt longer
than the model's positions, `max_tokens` beyond them, `logprobs` over `MAX_LOGPROBS`, or a
request larger than `--max-batch-tokens` is a 400 naming the field. Then the request becomes one
`Job` for the batcher, and its results become choices: for prompt i, completions i*n .. i*n+n-1.

Streaming (`stream: true`): with greedy decoding or sampling with `best_of` 1 and no
`logprobs`, the text is sent as its tokens are chosen (`StreamedText` holds back what a stop
string or half a character could still change); the last chunk of each choice completes its
text and carries `finish_reason` once the batch is done. A completion chosen only at the end
(beam search, the best `n` of `best_of` samples) or with `logprobs` comes in one chunk per
choice when the batch is done, its logprobs matching its text. Either way the chunks of a choice
join to the text of the same request without `stream`.

A client that goes away (it closes the connection, streaming or not) cancels its request: the
batcher drops its sequences at its next step. A full queue is a 429 with `Retry-After`; a
request past `--request-timeout` is a 504. The server's metrics (`ServerMetrics`) are observed
here, from the events every batcher delivers, so that they mean the same under either.
"""

import asyncio
import threading
import time
import uuid
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Sequence, Tuple

from metaseq_ds.errors import UsageError
from metaseq_ds.hub_utils import TextIds
from metaseq_ds.serving import protocol
from metaseq_ds.serving.batcher import Done, Failed, Job, JobQueue, QueueFull, Token
from metaseq_ds.serving.protocol import CompletionRequest, RequestError
from metaseq_ds.streamed_text import StreamedText

# Each position of a response carries this many alternatives at most (a bound on its size).
MAX_LOGPROBS = 20
# What a 429 asks the client to wait: about one long request's decoding on a busy server.
RETRY_AFTER_S = 1


class ServerFault(Exception):
    """Decoding failed for a reason of the server's, not the request's (HTTP 500), or ran past
    the request timeout (504)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Mailbox:
    """Events from the batcher's thread to the server's event loop, handed over in one wake-up
    of the loop for all that came since the last: a step of 16 streaming requests would
    otherwise wake it 16 times, each a system call and a turn of the loop holding the GIL the
    batcher needs."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: List[Tuple[asyncio.Queue, Any]] = []

    def post(self, queue: asyncio.Queue, event) -> None:
        with self.lock:
            self.pending.append((queue, event))
            if len(self.pending) > 1:
                return  # a wake-up is on its way
        try:
            self.loop.call_soon_threadsafe(self._hand_over)
        except RuntimeError:  # the event loop is gone: the server is stopping
            pass

    def _hand_over(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class Completions:
    """Turns requests into batcher jobs and their results into responses, for `interface`'s model."""

    def __init__(self, interface, batcher: JobQueue, model_name: str, metrics=None,
                 request_timeout: Optional[float] = None):
        self.interface = interface
        self.batcher = batcher
        self.model_name = model_name
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.positions = interface.max_positions()
        self.mailbox: Optional[Mailbox] = None  # made on the event loop, at the first request

    def job(self, request: CompletionRequest, deliver) -> Job:
        """The request as a job, or `RequestError` (400) if the model or the server cannot take it."""
        options = request.options
        if options.max_tokens >= self.positions:
            raise RequestError(400, f"max_tokens must be <= {self.positions - 1} (the model has {self.positions} "
                                    f"positions), got {options.max_tokens}", "max_tokens")
        if options.logprobs > MAX_LOGPROBS:
            raise RequestError(400, f"logprobs must be <= {MAX_LOGPROBS} on this server, got {options.logprobs}",
                               "logprobs")
        try:
            prompts = [self.interface.encode(prompt, index) for index, prompt in enumerate(request.prompts)]
        except UsageError as error:
            raise RequestError(400, str(error), "prompt") from None
        stream_tokens = request.stream and options.best_of == 1 and not request.logprobs
        job = Job(prompts, options, self.positions, deliver, stream_tokens=stream_tokens,
                  timeout=self.request_timeout)
        refused = self.batcher.refusal(job)
        if refused:
            field, message = refused
            raise RequestError(400, message, field)
        return job

    def submit(self, request: CompletionRequest):
        """Queue the request; returns its job and the asyncio queue its events arrive on."""
        if self.mailbox is None:
            self.mailbox = Mailbox(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()
        job = None

        def deliver(event) -> None:  # on the batcher's thread
            if isinstance(event, (Done, Failed)):
                job.finished = True
            self._observe(job, event)
            if isinstance(event, Token) and not job.stream_tokens:
                return
            self.mailbox.post(events, event)

        job = self.job(request, deliver)
        try:
            self.batcher.submit(job)
        except QueueFull as full:
            self._failed("rejected")
            raise RequestError(429, f"the server is busy: {full}; retry in {RETRY_AFTER_S} s",
                               code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except RuntimeError:  # closed: the server is stopping
            raise RequestError(503, "the server is shutting down", code="unavailable") from None
        return job, events

    def _observe(self, job: Job, event) -> None:
        if self.metrics is None:
            return
        if isinstance(event, Token):
            self.metrics.tokens(job)
        elif isinstance(event, Done):
            new_tokens = sum(len(result["tokens"]) for prompt_results in event.results for result in prompt_results)
            if job.first_token_at is None:  # not streamed (beam search): all at once
                self.metrics.tokens(job, new_tokens)
            self.metrics.prompt_tokens.inc(sum(len(prompt) for prompt in job.prompts))
            self.metrics.finished(job, [r["finish_reason"] for results in event.results for r in results])
        elif isinstance(event, Failed):
            self._failed("timed_out" if event.status == 504 else "server_error")

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.failed(reason)

    def cancel(self, job: Job) -> None:
        """The client went away before its answer: stop decoding it."""
        job.cancel()
        self.batcher.wake()
        self._failed("cancelled")

    def meta(self) -> Dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}

    async def complete(self, request: CompletionRequest, disconnected) -> Optional[Dict[str, Any]]:
        """The response of a request without `stream`; `disconnected()`: an awaitable that
        returns when the client has closed its connection (the request is then cancelled, and
        None returned)."""
        job, events = self.submit(request)
        gone = asyncio.ensure_future(disconnected())
        try:
            while True:
                getting = asyncio.ensure_future(events.get())
                await asyncio.wait({getting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():  # nobody is there to answer
                    getting.cancel()
                    self.cancel(job)
                    return None
                event = getting.result()
                if isinstance(event, Failed):
                    raise ServerFault(event.message, event.status)
                if isinstance(event, Done):
                    break
        finally:
            gone.cancel()
        choices = [protocol.choice(index, result, request.logprobs) for index, _, result in _choices(event.results)]
        new_tokens = sum(self._new_tokens(result, job.prompts[prompt], request)
                         for _, prompt, result in _choices(event.results))
        return protocol.completion(self.meta(), choices, sum(len(p) for p in job.prompts), new_tokens)

    def stream(self, request: CompletionRequest) -> AsyncIterator[str]:
        """The server-sent events of a request with `stream` (queued now: a bad request raises here)."""
        job, events = self.submit(request)
        return self._events(request, job, events, self.meta())

    async def _events(self, request: CompletionRequest, job: Job, events: asyncio.Queue,
                      meta: Dict[str, Any]) -> AsyncIterator[str]:
        texts = [self._streamed_text(request, prompt) for prompt in job.prompts] if job.stream_tokens else []
        try:
            async for piece in self._pieces(request, job, events, meta, texts):
                yield piece
        finally:  # the client went away (the response was cancelled, or closed) before the end
            if not job.finished:
                self.cancel(job)

    async def _pieces(self, request, job, events, meta, texts) -> AsyncIterator[str]:
        while True:
            event = await events.get()
            if isinstance(event, Token):
                piece = texts[event.prompt].push(event.token)
                if piece:  # one choice per prompt when tokens stream (n = best_of = 1)
                    yield protocol.chunk(meta, event.prompt, piece)
            elif isinstance(event, Done):
                for index, prompt, result in _choices(event.results):
                    text = texts[prompt].rest(result["text"]) if job.stream_tokens else result["text"]
                    logprobs = protocol.logprobs_object(result) if request.logprobs else None
                    yield protocol.chunk(meta, index, text, logprobs, protocol.FINISH_REASONS[result["finish_reason"]])
                break
            else:
                yield protocol.event(protocol.error_body(event.message, kind="server_error"))
                break
        yield protocol.DONE

    def _streamed_text(self, request: CompletionRequest, prompt: List[int]) -> StreamedText:
        stop_strings = [s for s in request.options.stop if isinstance(s, str)]
        return StreamedText(self.interface.tokenizer.decode, self.interface.special_ids(), stop_strings,
                            prompt=prompt if request.options.echo else ())

    def _new_tokens(self, result: dict, prompt: List[int], request: CompletionRequest) -> int:
        """Completion tokens of a result for `usage`: its tokens without the echoed prompt (a text
        prompt's without its special tokens, a token-id prompt's as sent: see `hub_utils.TextIds`)."""
        if not request.options.echo:
            echoed = 0
        elif isinstance(prompt, TextIds):
            echoed = sum(t not in self.interface.special_ids() for t in prompt)
        else:
            echoed = len(prompt)
        return len(result["tokens"]) - echoed


def _choices(results: Sequence[List[dict]]) -> Iterator[Tuple[int, int, dict]]:
    """(choice index, prompt index, result) in OpenAI's order: prompt by prompt, n completions each."""
    index = 0
    for prompt, prompt_results in enumerate(results):
        for result in prompt_results:
            yield index, prompt, result
            index += 1
