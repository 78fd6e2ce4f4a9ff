"""Seconds per engine step as a function of the step's shape, fitted by least squares.

A step runs the compiled programs of its bucket (T tokens, S sequences: the smallest buckets that
hold it), so its matmuls cost what T padded rows cost, its LM head and sampler what S rows cost;
attention costs what its tokens read: each token attends to every position before it in its
sequence, cached or new (a decode token reads its sequence's whole context, a prompt chunk of n
tokens after `start` cached ones reads n * start + n (n + 1) / 2 positions).

Decode steps (every sequence computes one token) and steps with prompt tokens are fitted apart, as
what dominates differs: a decode step of a few rows is a read of the weights (on CPU, the native
kernel's row calls; XLA's dot for more rows), a prompt step is compute over T rows; on a GPU both
are flatter. Neither is a straight line in the bucket (measured on a Zen 4: a decode step costs 35
ms at 8 sequences and 70 at 16; a prompt token 3.4 ms at 16 tokens, 1.4 at 128, 1.6 at 1024), so
each measured bucket gets its own base cost:

    decode:  seconds = host + base_decode[S_bucket] + d_attn * attended / 1000
    prefill: seconds = host + base_prefill[T_bucket] + p_seq * S_bucket + p_attn * prompt_attended / 1000
                       + p_decode_attn * decode_attended / 1000

A step with prompt tokens under the chunked policy also carries decodes, and a decode row's
attention is a read of its whole context for one token, where a prompt chunk's reads serve many:
per position attended, a decode costs several times what a prompt token does (4-5x on a Zen 4, in
a mixed step as in a decode step). Priced at the prompt tokens' rate, a chunk beside 40 decodes at
a 1024-token context came out 38% cheap (measured 1079 ms, priced 671), and the chunked policy's
loaded steps are all of that kind: the simulated prefill ran fast, the TTFT tail came out short.
So decode rows' positions get their own term, fitted on mixed steps with decodes at a short and a
long context (measure.grid).

A bucket that was not measured (a limit that is not a power of two) is priced by linear
interpolation between the measured buckets around it. `host` is the engine's own work per step
beside the runner's (scheduling, building the plan, output processing and detokenizing:
host_s_per_step + host_s_per_seq per sequence in the step), measured apart (tuning/measure.py).
The coefficients come from weighted non-negative least squares (each row weighted by 1 / its
seconds: relative errors count alike from a 1-token step to a 1024-token one; no cost is negative).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Callable

import numpy as np

from orca_jax.engine.step_plan import Buckets
from orca_jax.tuning.simulate import SimStep


def attended(chunks) -> int:
    """Positions the step's tokens attend to: chunk (start, n) reads n * start + n (n + 1) / 2."""
    return sum(n * start + n * (n + 1) // 2 for start, n in chunks)


def decode_attended(chunks) -> int:
    """Positions the step's decode rows (chunks of one token) attend to: their context and themselves."""
    return sum(start + 1 for start, n in chunks if n == 1)


def is_decode(chunks) -> bool:
    return all(n == 1 for _, n in chunks)


def interpolate(table: dict[int, float], x: int) -> float:
    """table[x], or the line through the measured buckets around x (beyond them: through the last two)."""
    if x in table:
        return table[x]
    keys = sorted(table)
    if len(keys) == 1:
        return table[keys[0]]
    i = min(max(bisect.bisect_left(keys, x), 1), len(keys) - 1)
    lo, hi = keys[i - 1], keys[i]
    return max(0.0, table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo))


@dataclasses.dataclass(frozen=True)
class CostModel:
    decode_base_s: dict[int, float]  # sequence bucket -> seconds of a decode step with nothing attended
    decode_per_1k_attended_s: float
    prefill_base_s: dict[int, float]  # token bucket -> seconds of a prompt step of one sequence, nothing attended
    prefill_per_seq_s: float  # each sequence bucket row beside the first
    prefill_per_1k_attended_s: float
    host_s_per_step: float = 0.0  # the engine's work per step beside the runner's ...
    host_s_per_seq: float = 0.0  # ... and per sequence the step runs
    # How well each regime's fit matches its own measurements: rms and max relative error, rows.
    fit_error: dict = dataclasses.field(default_factory=dict)
    # A step with prompt tokens: seconds per 1000 positions its decode rows attend to (None: the
    # prompt tokens' rate, as a model fitted without mixed steps at two contexts has it).
    prefill_per_1k_decode_attended_s: float | None = None

    @property
    def mixed_decode_per_1k_s(self) -> float:
        if self.prefill_per_1k_decode_attended_s is None:
            return self.prefill_per_1k_attended_s
        return self.prefill_per_1k_decode_attended_s

    def scaled(self, factor: float) -> "CostModel":
        """The model with every step costing `factor` times as much (every term is scaled: a step's
        price is linear in them): a machine that much slower than measured."""
        def times(table: dict[int, float]) -> dict[int, float]:
            return {k: factor * v for k, v in table.items()}

        mixed = self.prefill_per_1k_decode_attended_s
        return dataclasses.replace(
            self, decode_base_s=times(self.decode_base_s),
            decode_per_1k_attended_s=factor * self.decode_per_1k_attended_s,
            prefill_base_s=times(self.prefill_base_s), prefill_per_seq_s=factor * self.prefill_per_seq_s,
            prefill_per_1k_attended_s=factor * self.prefill_per_1k_attended_s,
            host_s_per_step=factor * self.host_s_per_step, host_s_per_seq=factor * self.host_s_per_seq,
            prefill_per_1k_decode_attended_s=None if mixed is None else factor * mixed)

    def device_seconds(self, chunks, token_bucket: int, seq_bucket: int) -> float:
        work = attended(chunks) / 1000
        if is_decode(chunks):
            return interpolate(self.decode_base_s, seq_bucket) + self.decode_per_1k_attended_s * work
        decode_work = decode_attended(chunks) / 1000
        return (interpolate(self.prefill_base_s, token_bucket) + self.prefill_per_seq_s * seq_bucket
                + self.prefill_per_1k_attended_s * (work - decode_work) + self.mixed_decode_per_1k_s * decode_work)

    def pricer(self, max_num_seqs: int, max_num_batched_tokens: int) -> Callable[[SimStep], float]:
        """Seconds of a simulated step under these limits (the runner's default buckets for them):
        `device_seconds` plus the host's share, with the bucket tables laid out once, as the search
        calls it for every step."""
        buckets = Buckets.for_limits(max_num_batched_tokens, max_num_seqs)
        token_bucket, seq_bucket = _lookup(buckets.tokens), _lookup(buckets.seqs)
        host = self.host_s_per_step
        decode_base = {s: host + interpolate(self.decode_base_s, s) for s in buckets.seqs}
        prefill_base = {t: host + interpolate(self.prefill_base_s, t) for t in buckets.tokens}
        decode_attn, per_seq = self.decode_per_1k_attended_s / 1000, self.prefill_per_seq_s
        prefill_attn, host_per_seq = self.prefill_per_1k_attended_s / 1000, self.host_s_per_seq
        mixed_decode_attn = self.mixed_decode_per_1k_s / 1000

        def step_seconds(step: SimStep) -> float:
            tokens, work, decode_work, only_decodes = 0, 0, 0, True
            for start, n in step.chunks:
                tokens += n
                if n == 1:
                    decode_work += start + 1
                else:
                    work += n * start + n * (n + 1) // 2
                    only_decodes = False
            padding = step.num_padding_seqs  # static's finished members: a row and a token each
            t, s = token_bucket[tokens + padding], seq_bucket[len(step.chunks) + padding]
            seconds = host_per_seq * len(step.chunks)
            if only_decodes:
                return seconds + decode_base[s] + decode_attn * (decode_work + padding)
            return seconds + prefill_base[t] + per_seq * s + prefill_attn * work + mixed_decode_attn * decode_work
        return step_seconds

    def to_json(self) -> dict:
        return {"decode": {"base_s_by_seq_bucket": {str(k): v for k, v in sorted(self.decode_base_s.items())},
                           "per_1k_attended_s": self.decode_per_1k_attended_s},
                "prefill": {"base_s_by_token_bucket": {str(k): v for k, v in sorted(self.prefill_base_s.items())},
                            "per_seq_s": self.prefill_per_seq_s, "per_1k_attended_s": self.prefill_per_1k_attended_s,
                            "per_1k_decode_attended_s": self.prefill_per_1k_decode_attended_s},
                "host_s_per_step": self.host_s_per_step, "host_s_per_seq": self.host_s_per_seq,
                "fit_error": self.fit_error,
                "formula": "decode: host + base_s_by_seq_bucket[S] + per_1k_attended_s * attended / 1000; prefill: "
                           "host + base_s_by_token_bucket[T] + per_seq_s * S + per_1k_attended_s * (what prompt "
                           "tokens attend to) / 1000 + per_1k_decode_attended_s (null: per_1k_attended_s) * (what "
                           "decode rows attend to) / 1000; "
                           "host = host_s_per_step + host_s_per_seq * sequences; buckets not measured are "
                           "interpolated"}

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        decode, prefill = data["decode"], data["prefill"]
        return cls({int(k): v for k, v in decode["base_s_by_seq_bucket"].items()}, decode["per_1k_attended_s"],
                   {int(k): v for k, v in prefill["base_s_by_token_bucket"].items()}, prefill["per_seq_s"],
                   prefill["per_1k_attended_s"], float(data.get("host_s_per_step", 0.0)),
                   float(data.get("host_s_per_seq", 0.0)), dict(data.get("fit_error", {})),
                   prefill.get("per_1k_decode_attended_s"))


def _lookup(buckets: tuple[int, ...]) -> list[int]:
    """bucket[n]: the smallest bucket holding n, for n up to the largest (Buckets.pick, as a table)."""
    table, i = [buckets[0]], 0
    for n in range(1, buckets[-1] + 1):
        while buckets[i] < n:
            i += 1
        table.append(buckets[i])
    return table


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measured step: its sequences as (start, n) chunks, its bucket, its seconds."""

    chunks: tuple[tuple[int, int], ...]
    token_bucket: int
    seq_bucket: int
    seconds: float


def _nnls_fit(x: np.ndarray, y: np.ndarray, kind: str) -> tuple[np.ndarray, dict]:
    """Weighted non-negative least squares (weights 1 / the fitted cost), and the fit's relative errors."""
    from scipy.optimize import nnls

    if np.any(y <= 0):
        raise ValueError(f"measured step times must be positive, got {y.min()}")
    if len(y) <= x.shape[1]:
        raise ValueError(f"fitting the {kind} steps' cost needs more measured steps than its {x.shape[1]} terms, "
                         f"got {len(y)}")
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)  # columns of unit size: a well-conditioned system
    # Relative errors, so every row counts alike whatever its size: weights 1 / the row's cost. Taken
    # as the measured time, a row measured slow weighs less than one measured fast, which pulls the
    # fit below the mean (by 2-12% of the grid's total on a loaded machine, where a TTFT tail at the
    # capacity moves several times as much); so the weights are then the fit's own prices.
    w = 1 / y
    for _ in range(3):
        solution, _ = nnls((x / scale) * w[:, None], y * w)
        beta = solution / scale
        predicted = x @ beta
        w = 1 / np.where(predicted > 0, predicted, y)
    relative = (x @ beta - y) / y
    return beta, {"rms_relative": float(np.sqrt(np.mean(relative ** 2))),
                  "max_relative": float(np.max(np.abs(relative))), "rows": int(len(y))}


def fit(timings: list[Timing], host_s_per_step: float = 0.0, host_s_per_seq: float = 0.0) -> CostModel:
    """The cost model by weighted non-negative least squares over the measured steps (see the
    module docstring): one base per measured bucket, the attention and per-sequence terms shared."""
    decode = [t for t in timings if is_decode(t.chunks)]
    prefill = [t for t in timings if not is_decode(t.chunks)]
    seq_buckets = sorted({t.seq_bucket for t in decode})
    token_buckets = sorted({t.token_bucket for t in prefill})
    x = np.array([[float(t.seq_bucket == b) for b in seq_buckets] + [attended(t.chunks) / 1000] for t in decode])
    decode_beta, decode_error = _nnls_fit(x.reshape(len(decode), len(seq_buckets) + 1),
                                          np.array([t.seconds for t in decode]), "decode")
    # Decode rows' positions get a term of their own where the mixed steps measured them at more
    # than one context (else the prompt tokens' rate stands in, as a term nothing tells apart).
    decode_work = [decode_attended(t.chunks) / 1000 for t in prefill]
    own_term = len({start for t in prefill for start, n in t.chunks if n == 1}) > 1  # decode contexts measured
    x = np.array([[float(t.token_bucket == b) for b in token_buckets]
                  + [t.seq_bucket, attended(t.chunks) / 1000 - (w if own_term else 0)] + ([w] if own_term else [])
                  for t, w in zip(prefill, decode_work)])
    terms = len(token_buckets) + 2 + own_term
    prefill_beta, prefill_error = _nnls_fit(x.reshape(len(prefill), terms),
                                            np.array([t.seconds for t in prefill]), "prefill")
    per_seq, per_1k = prefill_beta[len(token_buckets)], prefill_beta[len(token_buckets) + 1]
    return CostModel(dict(zip(seq_buckets, map(float, decode_beta))), float(decode_beta[-1]),
                     dict(zip(token_buckets, map(float, prefill_beta))), float(per_seq),
                     float(per_1k), host_s_per_step, host_s_per_seq,
                     {"decode": decode_error, "prefill": prefill_error},
                     float(prefill_beta[-1]) if own_term else None)
