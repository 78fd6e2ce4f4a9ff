"""bench/bench_serving.py's load generator against a real server (the tiny model), and its summary."""

import asyncio
import math
import sys

import pytest

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
from bench_serving import RequestResult, capacity, run_rate, summarize  # noqa: E402
from workloads import WorkloadRequest  # noqa: E402


def test_load_generator_measures_every_request(tiny_server):
    workload = [WorkloadRequest(counting_sequence(i, 1)[:3], max_tokens=5 + i) for i in range(12)]
    row = asyncio.run(run_rate(tiny_server.url, "tiny", workload, rate=50.0, max_concurrency=6, send_text=False))
    assert row["ok"] == row["requests"] == 12 and row["errors"] == []
    assert row["output_throughput"] * row["wall_s"] == pytest.approx(sum(5 + i for i in range(12)))
    assert 0 < row["ttft_s_p50"] <= row["ttft_s_p99"] <= row["e2e_s_p99"]
    assert row["itl_s_p50"] > 0 and row["normalized_s_per_token_p99"] > 0


def test_failed_requests_are_counted_not_hidden(tiny_server):
    workload = [WorkloadRequest([1, 2, 3], max_tokens=500)]  # past the tiny model's 128-token context
    row = asyncio.run(run_rate(tiny_server.url, "tiny", workload, rate=math.inf, max_concurrency=None,
                               send_text=False))
    assert row["ok"] == 0 and "400" in row["errors"][0] and "context length" in row["errors"][0]


def test_capacity_is_the_highest_rate_under_the_target():
    def row(rate, p99, ok=10):
        return {"rate": rate, "ok": ok, "requests": 10, "normalized_s_per_token_p99": p99}

    rows = [row(0.5, 0.1), row(1.0, 0.3), row(2.0, 0.6), row(4.0, 2.0), row("inf", 0.1)]
    assert capacity(rows, 0.5) == 1.0
    assert capacity(rows, 0.05) == 0.0
    assert capacity([row(0.5, 0.1), row(1.0, 0.2, ok=9)], 0.5) == 0.5  # a rate that lost requests does not count
    summary = summarize([RequestResult(True, 4, 0.1, 0.5, [0.1, 0.1, 0.2]), RequestResult(False, error="503: full")],
                        wall=2.0, rate=1.0, max_concurrency=None)
    assert summary["ok"] == 1 and summary["errors"] == ["503: full"] and summary["output_throughput"] == 2.0
    assert summary["normalized_s_per_token_p50"] == 0.125
