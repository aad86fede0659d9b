"""Prometheus metrics of the server (prometheus-client, one registry per server so several can live in a process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self, llm):
        self.llm = llm
        r = self.registry = CollectorRegistry()
        p = "llmkernels_"
        self.requests = Counter(p + "requests", "Finished requests by finish reason (abort: the client left)",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first generated token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Mean time between a request's generated tokens",
                              buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram(p + "request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY, registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps run", registry=r)
        self.graph_steps = Counter(p + "engine_graph_steps", "Engine steps replayed as CUDA graphs", registry=r)
        self._stats, self._graph_steps = llm.stats, llm.stats.graph_steps
        pool, sched = llm.pool, llm.scheduler
        Gauge(p + "kv_cache_used_pages", "KV-cache pages held by running sequences", registry=r).set_function(
            lambda: pool.num_used)
        Gauge(p + "kv_cache_usage_ratio", "Fraction of the KV-cache pages held by running sequences",
              registry=r).set_function(lambda: pool.num_used / pool.num_pages)
        Gauge(p + "kv_cache_cached_pages", "KV-cache pages named in the prefix cache (in use or idle)",
              registry=r).set_function(lambda: pool.num_cached)
        Gauge(p + "num_requests_running", "Sequences being generated", registry=r).set_function(
            lambda: len(sched.running))
        Gauge(p + "num_requests_waiting", "Sequences queued for their first step", registry=r).set_function(
            lambda: len(sched.waiting))
        self._in_flight = Gauge(p + "num_requests_in_flight", "Requests accepted and not yet answered", registry=r)

    def on_step(self) -> None:
        self.steps.inc()
        n = self._stats.graph_steps
        if n > self._graph_steps:
            self.graph_steps.inc(n - self._graph_steps)
        self._graph_steps = n

    def request_done(self, h, now: float, n_out: int, reasons: list) -> None:
        for reason in reasons:
            self.requests.labels(reason or "abort").inc()
        self.prompt_tokens.inc(len(h.prompt_ids))
        self.cached_tokens.inc(h.num_cached_tokens)
        self.generation_tokens.inc(n_out)
        if h.first_token is not None:
            self.ttft.observe(h.first_token - h.arrival)
            per_seq = n_out / max(1, h.params.n)
            if per_seq > 1:
                self.tpot.observe((now - h.first_token) / (per_seq - 1))
        self.e2e.observe(now - h.arrival)

    def render(self, in_flight: int) -> tuple[bytes, str]:
        self._in_flight.set(in_flight)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
