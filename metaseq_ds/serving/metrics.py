"""What `GET /metrics` reports, in Prometheus' text format (`prometheus_client`), named as vLLM
names its own with the `mseq_` prefix, so dashboards built for one read the other:

    mseq_requests_running / mseq_requests_waiting            gauges: decoding now / queued
    mseq_prompt_tokens_total / mseq_generation_tokens_total  counters: tokens prefilled / chosen
    mseq_request_success_total{finished_reason}              counter: completed requests
    mseq_request_failure_total{reason}                       counter: cancelled, timed_out, rejected, server_error
    mseq_time_to_first_token_seconds                         histogram: arrival -> first new token
    mseq_time_per_output_token_seconds                       histogram: between a request's new tokens
    mseq_e2e_request_latency_seconds                         histogram: arrival -> last token

Each server has a registry of its own (not prometheus_client's global one), so several apps in
one process (tests, benchmarks) do not collide. The batchers observe a request through its
`Job` (arrival, first and last token times), from their worker thread; prometheus_client's
metrics are thread-safe.
"""

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds): from a fast GPU's milliseconds to a long generation's minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("mseq_requests_running", "Requests being decoded", registry=r)
        self.waiting = Gauge("mseq_requests_waiting", "Requests queued, not yet decoding", registry=r)
        self.prompt_tokens = Counter("mseq_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("mseq_generation_tokens", "New tokens chosen", registry=r)
        self.successes = Counter("mseq_request_success", "Requests completed", ["finished_reason"], registry=r)
        self.failures = Counter("mseq_request_failure", "Requests that did not complete", ["reason"], registry=r)
        self.time_to_first_token = Histogram("mseq_time_to_first_token_seconds", "Arrival to first new token",
                                             buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("mseq_time_per_output_token_seconds",
                                               "Time between a request's new tokens", buckets=TPOT_BUCKETS, registry=r)
        self.e2e_latency = Histogram("mseq_e2e_request_latency_seconds", "Arrival to the request's last token",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def tokens(self, job, count: int = 1) -> None:
        """`count` new tokens of `job` chosen now (in one step, or at once by a static batch)."""
        now = time.monotonic()
        if job.first_token_at is None:
            job.first_token_at = now
            self.time_to_first_token.observe(now - job.arrived)
        elif count:
            self.time_per_output_token.observe((now - job.last_token_at) / count)
        job.last_token_at = now
        self.generation_tokens.inc(count)

    def finished(self, job, reasons) -> None:
        self.e2e_latency.observe(time.monotonic() - job.arrived)
        for reason in reasons:
            self.successes.labels(finished_reason=reason).inc()

    def failed(self, reason: str) -> None:
        self.failures.labels(reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
