"""Latency summaries shared by the benchmarks."""

from __future__ import annotations

import numpy as np


def percentiles(values) -> dict:
    """mean, p50, p90, p99 (linear interpolation, numpy's default); {} for no values."""
    if len(values) == 0:
        return {}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"mean": float(np.mean(values)), "p50": float(p50), "p90": float(p90), "p99": float(p99)}
