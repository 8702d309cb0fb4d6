"""Servers for the `mseq serve` tests: in this process on a thread (fast: one model load for many
tests), or as a real `mseq serve` / deepspeed launch whose address line is read from stdout."""

import contextlib
import http.client
import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional, Tuple

from convert_helpers import TINY_MODEL, write_zero0_checkpoint

POSITIONS = 64
API_KEY = "test-key"


def write_checkpoint(save_dir: Path) -> Path:
    """A tiny random byte-level model (4 heads: 2 ranks can split it) with 64 positions."""
    flags = [flag if flag != "16" else str(POSITIONS) for flag in TINY_MODEL]
    assert flags[flags.index("--tokens-per-sample") + 1] == str(POSITIONS)
    write_zero0_checkpoint(save_dir, flags)
    return save_dir


@contextlib.contextmanager
def server_thread(interface, runner=None, api_key: Optional[str] = API_KEY, max_batch_tokens: int = 4096,
                  max_request_bytes: int = 65536, **serve_options):
    """`mseq serve`'s app for `interface` on 127.0.0.1 (a free port), uvicorn on a thread; yields
    its `url` and its `batcher`. `serve_options`: other `ServeOptions` fields (`batching`, ...)."""
    import uvicorn

    from metaseq_ds.cli.serve import bind, build_app
    from metaseq_ds.serving.options import ServeOptions
    from metaseq_ds.serving.runner import ModelRunner

    runner = runner or ModelRunner(interface, ranks=1)
    options = ServeOptions("tiny", api_key=api_key, max_batch_tokens=max_batch_tokens,
                           max_request_bytes=max_request_bytes, **serve_options)
    app, batcher = build_app(interface, runner, "tiny", options)
    listener = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.05)
    try:
        yield SimpleNamespace(url=f"http://127.0.0.1:{listener.getsockname()[1]}", batcher=batcher)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        batcher.close()


def start_process(command, env: Dict[str, str], timeout: float = 300) -> Tuple[subprocess.Popen, str]:
    """Start `mseq serve` (alone or under a launcher) in a process group of its own; returns the
    process and the URL it printed."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    lines: "queue.Queue[Optional[str]]" = queue.Queue()

    def read(stream):
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, args=(process.stdout,), daemon=True).start()
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.startswith("mseq serve: ") and " on http://" in line:
            url = line.split(" on ", 1)[1].split()[0]
            wait_healthy(url, deadline)
            return process, url
    os.killpg(process.pid, signal.SIGKILL)
    _, err = process.communicate(timeout=30)
    raise AssertionError(f"{command} printed no address:\n{''.join(seen)[-3000:]}\n{err[-5000:]}")


def interrupt(process: subprocess.Popen, timeout: float = 90) -> int:
    """Ctrl-C as a terminal sends it (to the whole process group: a launcher and its ranks);
    returns the exit code, after killing the group if it did not stop within `timeout`."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def wait_healthy(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if request(url, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}/health never answered")


def request(url: str, method: str, path: str, body=None, headers: Optional[Dict[str, str]] = None):
    """(status, parsed JSON body) of one plain HTTP request; `body`: bytes as given, else JSON."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, json.loads(payload) if payload else None


def bearer(key: str = API_KEY) -> Dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def slow_steps(monkeypatch, batcher, delay: float = 0.02) -> None:
    """Each decoding step of a continuous `batcher` takes at least `delay` s: the tiny model's
    take well under a millisecond, too fast to act between them."""
    step = batcher.decoding.step

    def slowed(*args, **kwargs):
        time.sleep(delay)
        return step(*args, **kwargs)

    monkeypatch.setattr(batcher.decoding, "step", slowed)


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
