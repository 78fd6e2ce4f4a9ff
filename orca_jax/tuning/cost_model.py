"""Seconds per engine step as a linear function of the step's shape, fitted by least squares.

A step runs the compiled programs of its bucket (T tokens, S sequences: the smallest buckets that
hold it), so its matmuls cost what T padded rows cost, its LM head and sampler what S rows cost;
attention costs what its tokens read: each token attends to every position before it in its
sequence, cached or new (a decode token reads its sequence's whole context, a prompt chunk of n
tokens after `start` cached ones reads n * start + n (n + 1) / 2 positions).

Decode steps (every sequence computes one token) and steps with prompt tokens are fitted apart, as
what dominates differs: a decode step of a few rows is a read of the weights (on CPU, the native
kernel's row calls), a prompt step is compute over T rows; on a GPU both are flatter in T. So

    decode:  seconds = host + d0 + d_seq * S_bucket + d_attn * attended / 1000
    prefill: seconds = host + p0 + p_token * T_bucket + p_seq * S_bucket + p_attn * attended / 1000

with `host` the engine's own work per step beside the runner's (scheduling, building the plan,
output processing and detokenizing: host_s_per_step + host_s_per_seq per sequence in the step),
measured apart (tuning/measure.py). The coefficients come from weighted
non-negative least squares (each row weighted by 1 / its seconds: relative errors count alike
from a 1-token step to a 1024-token one; a cost is never negative).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from orca_jax.engine.step_plan import Buckets
from orca_jax.tuning.simulate import SimStep

DECODE_TERMS = ("intercept_s", "per_seq_s", "per_1k_attended_s")
PREFILL_TERMS = ("intercept_s", "per_token_s", "per_seq_s", "per_1k_attended_s")


def _lookup(buckets: tuple[int, ...]) -> list[int]:
    """bucket[n]: the smallest bucket holding n, for n up to the largest (Buckets.pick, as a table)."""
    table, i = [buckets[0]], 0
    for n in range(1, buckets[-1] + 1):
        while buckets[i] < n:
            i += 1
        table.append(buckets[i])
    return table


def attended(chunks) -> int:
    """Positions the step's tokens attend to: chunk (start, n) reads n * start + n (n + 1) / 2."""
    return sum(n * start + n * (n + 1) // 2 for start, n in chunks)


def is_decode(chunks) -> bool:
    return all(n == 1 for _, n in chunks)


def features(chunks, token_bucket: int, seq_bucket: int) -> tuple[str, list[float]]:
    """The step's regime ("decode" or "prefill") and its feature row, in DECODE_TERMS or PREFILL_TERMS order."""
    work = attended(chunks) / 1000
    if is_decode(chunks):
        return "decode", [1.0, seq_bucket, work]
    return "prefill", [1.0, token_bucket, seq_bucket, work]


@dataclasses.dataclass(frozen=True)
class CostModel:
    decode: dict[str, float]  # DECODE_TERMS -> coefficient
    prefill: dict[str, float]  # PREFILL_TERMS -> coefficient
    host_s_per_step: float = 0.0  # the engine's work per step beside the runner's ...
    host_s_per_seq: float = 0.0  # ... and per sequence the step runs
    # How well each regime's fit matches its own measurements: rms and max relative error, rows.
    fit_error: dict = dataclasses.field(default_factory=dict)

    def device_seconds(self, chunks, token_bucket: int, seq_bucket: int) -> float:
        kind, row = features(chunks, token_bucket, seq_bucket)
        coefficients = self.decode if kind == "decode" else self.prefill
        terms = DECODE_TERMS if kind == "decode" else PREFILL_TERMS
        return sum(coefficients[t] * x for t, x in zip(terms, row))

    def pricer(self, max_num_seqs: int, max_num_batched_tokens: int) -> Callable[[SimStep], float]:
        """Seconds of a simulated step under these limits (the runner's default buckets for them):
        `device_seconds` plus the host's share, inlined, as the search calls it for every step."""
        buckets = Buckets.for_limits(max_num_batched_tokens, max_num_seqs)
        token_bucket, seq_bucket = _lookup(buckets.tokens), _lookup(buckets.seqs)
        d, p = self.decode, self.prefill
        decode = (self.host_s_per_step + d["intercept_s"], d["per_seq_s"], d["per_1k_attended_s"] / 1000)
        prefill = (self.host_s_per_step + p["intercept_s"], p["per_token_s"], p["per_seq_s"],
                   p["per_1k_attended_s"] / 1000)
        host_per_seq = self.host_s_per_seq

        def step_seconds(step: SimStep) -> float:
            tokens, work, only_decodes = 0, 0, True
            for start, n in step.chunks:
                tokens += n
                work += n * start + n * (n + 1) // 2
                only_decodes = only_decodes and n == 1
            padding = step.num_padding_seqs  # static's finished members: a row and a token each
            t, s = token_bucket[tokens + padding], seq_bucket[len(step.chunks) + padding]
            work += padding
            host = host_per_seq * len(step.chunks)
            if only_decodes:
                return host + decode[0] + decode[1] * s + decode[2] * work
            return host + prefill[0] + prefill[1] * t + prefill[2] * s + prefill[3] * work
        return step_seconds

    def to_json(self) -> dict:
        return {"decode": self.decode, "prefill": self.prefill, "host_s_per_step": self.host_s_per_step,
                "host_s_per_seq": self.host_s_per_seq, "fit_error": self.fit_error,
                "formula": "seconds = host_s_per_step + host_s_per_seq * seqs + intercept_s + per_token_s * "
                           "token_bucket + per_seq_s * seq_bucket + per_1k_attended_s * attended / 1000 (decode "
                           "steps: no per_token_s)"}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        return cls(dict(data["decode"]), dict(data["prefill"]), float(data.get("host_s_per_step", 0.0)),
                   float(data.get("host_s_per_seq", 0.0)), dict(data.get("fit_error", {})))


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measured step: its sequences as (start, n) chunks, its bucket, its seconds."""

    chunks: tuple[tuple[int, int], ...]
    token_bucket: int
    seq_bucket: int
    seconds: float


def fit(timings: list[Timing], host_s_per_step: float = 0.0, host_s_per_seq: float = 0.0) -> CostModel:
    """The cost model by weighted non-negative least squares over the measured steps (see the
    module docstring). Each regime needs more rows than terms, with the terms varying."""
    from scipy.optimize import nnls

    rows = {"decode": [], "prefill": []}
    for timing in timings:
        kind, row = features(timing.chunks, timing.token_bucket, timing.seq_bucket)
        rows[kind].append((row, timing.seconds))
    coefficients, errors = {}, {}
    for kind, terms in (("decode", DECODE_TERMS), ("prefill", PREFILL_TERMS)):
        if len(rows[kind]) < len(terms) + 1:
            raise ValueError(f"fitting the {kind} steps' cost needs at least {len(terms) + 1} measured steps of "
                             f"that kind, got {len(rows[kind])}")
        x = np.array([r for r, _ in rows[kind]], dtype=np.float64)
        y = np.array([s for _, s in rows[kind]], dtype=np.float64)
        if np.any(y <= 0):
            raise ValueError(f"measured step times must be positive, got {y.min()}")
        w = 1 / y  # relative errors: every row counts alike, whatever its size
        # Columns scaled to unit size so the solver sees a well-conditioned system.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        solution, _ = nnls((x / scale) * w[:, None], y * w)
        beta = solution / scale
        coefficients[kind] = {t: float(b) for t, b in zip(terms, beta)}
        relative = (x @ beta - y) / y
        errors[kind] = {"rms_relative": float(np.sqrt(np.mean(relative ** 2))),
                        "max_relative": float(np.max(np.abs(relative))), "rows": int(len(y))}
    return CostModel(coefficients["decode"], coefficients["prefill"], host_s_per_step, host_s_per_seq, errors)
