"""`mseq serve` under load and faults: a full queue is a 429 with Retry-After; a client that goes
away (streaming or not) cancels its request within a step; /metrics carries vLLM's metrics under
`mseq_` names, counting what was served; SIGTERM finishes the requests in flight and refuses new
connections; memory stays flat over 1,000 requests with bad ones mixed in."""

import http.client
import json
import os
import signal
import socket
import sys
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch import env
from serving import (POSITIONS, bearer, request, server_thread, slow_steps, start_process, wait_until,
                     write_checkpoint)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "ckpt")


@pytest.fixture(scope="module")
def interface(checkpoint):
    from metaseq_ds.hub_utils import GeneratorInterface

    interface = GeneratorInterface(str(checkpoint))
    interface.load_model()
    return interface


def _metrics(url):
    """{sample name with labels: value} of GET /metrics (which needs no key)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/plain")
    text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" not in sample.labels:
                samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def _post(url, body, timeout=60):
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    connection.request("POST", "/v1/completions", body=json.dumps(body),
                       headers={"Content-Type": "application/json", **bearer()})
    return connection, connection.getresponse()


LONG = {"prompt": "the model", "temperature": 0, "max_tokens": 50, "min_tokens": 50}


def test_a_full_queue_is_a_429_with_retry_after_and_the_queued_requests_still_finish(interface, monkeypatch):
    with server_thread(interface, max_batch_tokens=POSITIONS, max_queued_requests=1) as running:  # 1 slot
        slow_steps(monkeypatch, running.batcher)
        answers = {}

        def send(name):
            answers[name] = request(running.url, "POST", "/v1/completions", LONG, bearer())

        threads = [threading.Thread(target=send, args=("running",))]
        threads[0].start()
        wait_until(lambda: running.batcher.requests)
        threads.append(threading.Thread(target=send, args=("queued",)))
        threads[1].start()
        wait_until(lambda: running.batcher.waiting)
        connection, response = _post(running.url, LONG)
        body = json.loads(response.read())
        assert response.status == 429 and response.getheader("Retry-After") == "1"
        assert body["error"]["code"] == "rate_limit_exceeded" and "--max-queued-requests" in body["error"]["message"]
        for thread in threads:
            thread.join(120)
        assert [answers[name][0] for name in ("running", "queued")] == [200, 200]
        assert answers["queued"][1]["usage"]["completion_tokens"] == 50
        assert _metrics(running.url)["mseq_request_failure_total{reason=rejected}"] == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_goes_away_cancels_its_request_within_a_step(interface, monkeypatch, stream):
    with server_thread(interface) as running:
        slow_steps(monkeypatch, running.batcher)
        host, port = running.url.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)))
        body = json.dumps({**LONG, "stream": stream}).encode()
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       + f"Authorization: Bearer {bearer()['Authorization'].split()[1]}\r\n".encode()
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if stream:
            received = b""
            while b"data: " not in received:  # the first piece came: it is decoding
                received += client.recv(65536)
        else:
            wait_until(lambda: running.batcher.requests)
        client.close()
        wait_until(lambda: not running.batcher.requests, timeout=5)  # 50 slowed steps would take 1 s or more
        samples = _metrics(running.url)
        assert samples["mseq_request_failure_total{reason=cancelled}"] == 1
        assert samples["mseq_generation_tokens_total"] < 50
        assert running.batcher.free == list(range(running.batcher.slots))


def test_metrics_count_what_was_served_under_vllms_names(interface):
    with server_thread(interface) as running:
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        # min_tokens = max_tokens: each prompt decodes exactly max_tokens (`usage` counts those of
        # them its text shows: a random model's <s> or <unk> is left out).
        bodies = [{"prompt": "the model", "max_tokens": 7, "min_tokens": 7},
                  {"prompt": ["a", "batch of"], "max_tokens": 5, "min_tokens": 5},
                  {"prompt": "weights", "max_tokens": 4, "min_tokens": 4, "echo": True, "logprobs": 1}]
        for body in bodies:
            status, answer = request(running.url, "POST", "/v1/completions", body, bearer())
            assert status == 200
            for key in usage:
                usage[key] += answer["usage"][key]
        # The counters count before a response leaves; the gauges follow the decoding worker,
        # which may end its turn just after the last response was sent, and must then fall to 0.
        wait_until(lambda: _metrics(running.url)["mseq_requests_running"] == 0, timeout=30)
        samples = _metrics(running.url)
    for name in ("mseq_requests_running", "mseq_requests_waiting", "mseq_generation_tokens_total",
                 "mseq_prompt_tokens_total", "mseq_time_to_first_token_seconds_count",
                 "mseq_time_per_output_token_seconds_count", "mseq_e2e_request_latency_seconds_count"):
        assert name in samples, name
    assert samples["mseq_generation_tokens_total"] == 7 + 2 * 5 + 4 >= usage["completion_tokens"]
    assert samples["mseq_prompt_tokens_total"] == usage["prompt_tokens"]
    assert samples["mseq_e2e_request_latency_seconds_count"] == len(bodies)
    assert samples["mseq_time_to_first_token_seconds_count"] == len(bodies)
    assert samples["mseq_requests_running"] == samples["mseq_requests_waiting"] == 0
    assert sum(v for k, v in samples.items() if k.startswith("mseq_request_success_total")) == 4  # choices


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_and_refuses_new_ones(checkpoint):
    command = [sys.executable, "-m", "metaseq_ds.cli.main", "serve", "--path", str(checkpoint), "--port", "0",
               "--max-batch-tokens", str(POSITIONS)]  # one slot: the requests decode one after another
    process, url = start_process(command, env())
    try:
        answers = []

        def send():
            answers.append(request(url, "POST", "/v1/completions", LONG))

        threads = [threading.Thread(target=send) for _ in range(12)]
        for thread in threads:
            thread.start()
        wait_until(lambda: _metrics(url).get("mseq_requests_waiting", 0) >= 8)
        os.kill(process.pid, signal.SIGTERM)
        for thread in threads:
            thread.join(120)
        assert [status for status, _ in answers] == [200] * 12
        # Whole: the same greedy completion of all 50 tokens, every time.
        assert {(answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]) for _, answer in answers} == \
            {(answers[0][1]["choices"][0]["text"], "length")}
        with pytest.raises(OSError):
            request(url, "GET", "/health")
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


BAD = [b'{"prompt": ', {"prompt": "x", "max_tokens": 0}, {"prompt": [5, 99999]}, {"prompt": "x", "logprobs": 50},
       {"prompt": "word " * 20}]


@pytest.mark.slow
def test_memory_stays_flat_over_1000_requests_with_bad_ones_mixed_in(checkpoint):
    command = [sys.executable, "-m", "metaseq_ds.cli.main", "serve", "--path", str(checkpoint), "--port", "0"]
    process, url = start_process(command, env())
    try:
        def burst(start, count):
            for i in range(start, start + count):
                if i % 10 == 9:
                    status, answer = request(url, "POST", "/v1/completions", BAD[i // 10 % len(BAD)], bearer())
                    assert 400 <= status < 500 and "\n" not in answer["error"]["message"]
                else:
                    body = {"prompt": "the model " * (1 + i % 5), "max_tokens": 1 + i % 13, "temperature": i % 2,
                            "echo": i % 7 == 0, "logprobs": 1 if i % 3 == 0 else None, "stream": i % 4 == 0}
                    connection, response = _post(url, body)
                    assert response.status == 200
                    response.read()
                    connection.close()

        burst(0, 200)  # warm: the allocator's pools and the caches filled
        warm = _rss_kib(process.pid)
        burst(200, 800)
        assert _rss_kib(process.pid) <= 1.10 * warm
        assert request(url, "GET", "/health")[0] == 200
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
