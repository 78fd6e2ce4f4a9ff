"""Prometheus metrics for /metrics, with prometheus_client. No jax.

Two sources: the engine's EngineStats snapshot (gauges and counters the engine thread publishes
after each step, read at scrape time by a custom collector) and per-request observations the
handlers make (latency histograms, prompt tokens, request outcomes). Each server has its own
registry, so several apps can live in one process (the tests do).
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from orca_jax.engine.async_engine import EngineStats
from orca_jax.engine.speculation import SpeculationStats
from orca_jax.outputs import RequestMetrics

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
ITERATION_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Reads the latest EngineStats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        # /health's answer as a series, so an alert can tell "compiling too long" from "down" (up == 0).
        yield GaugeMetricFamily("orca_jax_engine_ready", "1 once the engine is warmed up and serving, 0 while "
                                "it loads and compiles", value=0 if stats is None else 1)
        if stats is None:  # still warming up
            return
        gauges = (("orca_jax_num_requests_running", "Sequences in the running batch", stats.num_running),
                  ("orca_jax_num_requests_waiting", "Sequences waiting for admission", stats.num_waiting),
                  ("orca_jax_kv_cache_usage", "Fraction of KV cache pages in use (0-1)", stats.kv_usage),
                  ("orca_jax_compilations_after_warmup",
                   "XLA compilations after warm-up (each is a serving stall; should stay 0)",
                   stats.compilations_after_warmup))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (("orca_jax_preemptions", "Requests preempted to free KV pages", stats.num_preemptions),
                    ("orca_jax_iterations", "Engine iterations (forward passes)", stats.num_steps),
                    ("orca_jax_generation_tokens", "Tokens generated", stats.num_generated_tokens))
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        if stats.speculation is not None:
            yield from _speculation_metrics(stats.speculation)


def _speculation_metrics(spec: SpeculationStats):
    """vLLM's spec_decode_* counters: the mean acceptance length is 1 + accepted / drafts, the
    acceptance rate accepted / draft tokens, and per position the share of drafts that got that far."""
    counters = (("orca_jax_spec_decode_num_drafts", "Request steps that verified draft tokens", spec.num_drafts),
                ("orca_jax_spec_decode_num_draft_tokens", "Draft tokens verified", spec.num_draft_tokens),
                ("orca_jax_spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens))
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)
    per_position = CounterMetricFamily("orca_jax_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted, by position in the draft (0: the first)",
                                       labels=["position"])
    for position, value in enumerate(spec.accepted_per_position):
        per_position.add_metric([str(position)], value)
    yield per_position


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        r = self.registry
        self.prompt_tokens = Counter("orca_jax_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.requests = Counter("orca_jax_requests", "Finished sequences by outcome: stop, length, abort, error, "
                                "cancelled (the client left)", ["outcome"], registry=r)
        self.iteration_tokens = Histogram("orca_jax_iteration_tokens", "Tokens computed per iteration",
                                          buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("orca_jax_time_to_first_token_seconds", "Arrival to first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("orca_jax_inter_token_latency_seconds",
                                             "Time between a request's successive tokens",
                                             buckets=TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("orca_jax_e2e_request_latency_seconds", "Arrival to finish",
                                     buckets=LATENCY_BUCKETS, registry=r)
        # As vLLM's prefix_cache_queries/hits: prompt tokens looked up in the prefix cache, and those it served
        # (hits stay 0 with prefix caching off). Counted per finished sequence, from its RequestMetrics.
        self.prefix_cache_queries = Counter("orca_jax_prefix_cache_queries",
                                            "Prompt tokens of finished sequences looked up in the prefix cache",
                                            registry=r)
        self.prefix_cache_hits = Counter("orca_jax_prefix_cache_hits",
                                         "Prompt tokens of finished sequences served by the prefix cache",
                                         registry=r)
        self.queue_time = Histogram("orca_jax_request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=LATENCY_BUCKETS, registry=r)
        # The configured limit, so batch utilisation (running / max_num_seqs) can be computed in PromQL
        # (as vLLM users read it from the engine's config); set once the engine is built.
        self.max_num_seqs = Gauge("orca_jax_max_num_seqs", "Configured --max-num-seqs: sequences the engine runs "
                                  "at once", registry=r)

    def set_engine_limits(self, max_num_seqs: int) -> None:
        """Called once the engine is ready."""
        self.max_num_seqs.set(max_num_seqs)

    def on_step(self, stats: EngineStats) -> None:
        """Called by the engine thread after every iteration."""
        self.iteration_tokens.observe(stats.last_step_num_tokens)

    def on_finished(self, metrics: RequestMetrics, outcome: str, num_prompt_tokens: int) -> None:
        self.requests.labels(outcome).inc()
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(metrics.num_cached_prompt_tokens)
        if metrics.time_to_first_token is not None:
            self.time_to_first_token.observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self.queue_time.observe(metrics.queue_time)
        if metrics.finished_time is not None:
            self.e2e_latency.observe(metrics.finished_time - metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
