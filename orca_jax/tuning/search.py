"""The search: every setting the memory plan allows, priced by the simulation against the workload.

The settings searched are the scheduling policy, `max_num_seqs`, `max_num_batched_tokens` (the
token budget of a step, which is also the chunked policy's prompt chunk: orca_jax has no separate
chunk size) and the KV cache's memory. Before anything is simulated, each combination goes through
the memory plan (parallel/memory_plan.py, the same check the engine makes at start-up): a KV budget
that does not fit beside the parameters, or that cannot hold one sequence of max_model_len, is
refused, and so is one that cannot hold the workload's longest request, or a token budget below
its longest prompt for a policy that does not split prompts. Refused settings are listed with the
reason and never simulated or proposed.

Objective (`Target`): with a rate, the settings whose p99 TTFT and TPOT at that rate are furthest
under the targets (the lowest `score`, the larger of the two p99 / target ratios); without one, the
largest arrival rate whose p99s meet both targets (its `capacity`, found by bisection on the rate:
the same requests and arrival pattern, stretched), and among the settings within the bisection's
resolution of the best, the one with the lowest score at that common rate, then the least KV memory.

A cost margin (`tune --max-rate`): the search runs on the cost model with every step that much
dearer (CostModel.scaled), so the capacity it finds, the rate `tune` recommends, still meets the
target on a machine that runs that much slower than it was measured; the nominal capacity (the
measured costs) is found for the winner alone. Scaling every step by k is scaling time by k: the
recommended rate is the nominal capacity under targets 1 / k as long, divided by k.

KV memory only matters when pages run short: once a KV budget never ran short at any rate its
search tried, a larger one would give the very same runs, so it is not simulated again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Iterable

import numpy as np

from orca_jax.config import ConfigError
from orca_jax.tuning.cost_model import CostModel
from orca_jax.tuning.simulate import POLICIES, SimConfig, SimResult, simulate_arrivals
from orca_jax.tuning.workload import Workload

# The margin of step cost under which `tune --max-rate` recommends a rate: twice the 1.05x that the
# verifying run's iteration count showed on a quiet Zen 4 (2026-12-05, SmolLM2: TTFT p99 predicted
# 37% short at the nominal capacity), above the fit's largest residual there (8%, rms 1.4% decode,
# 2.4% prefill); a shared machine drifted further (0.8x-1.05x between measuring and verifying).
DEFAULT_COST_MARGIN = 0.10
RATE_RESOLUTION = 0.03  # the capacity bisection stops when hi / lo is within this of 1
COARSE_RESOLUTION = 0.15  # ... for a candidate that cannot beat the best found so far


@dataclasses.dataclass(frozen=True)
class Settings:
    policy: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_memory: int  # bytes per device
    num_pages: int  # the KV pages the memory plan gives that budget
    page_size: int

    @property
    def label(self) -> str:
        return (f"{self.policy} seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens} "
                f"kv={self.kv_cache_memory / 2**20:g}MiB")

    def to_json(self) -> dict:
        """As a tune report's `settings`."""
        return {"policy": self.policy, "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens, "kv_cache_memory": self.kv_cache_memory,
                "num_kv_pages": self.num_pages, "page_size": self.page_size}

    @classmethod
    def from_json(cls, data: dict) -> "Settings":
        return cls(data["policy"], data["max_num_seqs"], data["max_num_batched_tokens"], data["kv_cache_memory"],
                   data["num_kv_pages"], data["page_size"])


@dataclasses.dataclass(frozen=True)
class Space:
    """The values searched along each axis."""

    policies: tuple[str, ...] = POLICIES
    max_num_seqs: tuple[int, ...] = (4, 8, 16, 32, 64)
    max_num_batched_tokens: tuple[int, ...] = (128, 256, 512, 1024)
    kv_cache_memory: tuple[int, ...] = tuple(2**n << 20 for n in range(6, 13))  # 64 MiB .. 4 GiB

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                raise ValueError(f"the search's {name} needs positive values, got {values}")
        unknown = [p for p in self.policies if p not in POLICIES]
        if not self.policies or unknown:
            raise ValueError(f"policies {list(self.policies)}: choose among {list(POLICIES)}")


@dataclasses.dataclass(frozen=True)
class Target:
    ttft_p99_s: float
    tpot_p99_s: float
    rate: float | None = None  # requests/s: best p99s at this rate; None: the largest rate meeting both

    def __post_init__(self):
        if not (self.ttft_p99_s > 0 and self.tpot_p99_s > 0):
            raise ValueError(f"latency targets must be positive seconds, got TTFT {self.ttft_p99_s}, "
                             f"TPOT {self.tpot_p99_s}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"the arrival rate must be positive, got {self.rate}")


@dataclasses.dataclass(frozen=True)
class Point:
    """One simulated run: the settings at an arrival rate, and its p99s."""

    rate: float
    ttft_p99_s: float
    tpot_p99_s: float
    preemptions: int
    kv_bound: bool
    steps: int = 0  # engine iterations
    end_s: float = 0.0  # when the last request finished

    def score(self, target: Target) -> float:
        return max(self.ttft_p99_s / target.ttft_p99_s, self.tpot_p99_s / target.tpot_p99_s)

    def meets(self, target: Target) -> bool:
        return self.score(target) <= 1.0

    def to_json(self) -> dict:
        return {"rate_rps": self.rate, "ttft_p99_s": self.ttft_p99_s, "tpot_p99_s": self.tpot_p99_s,
                "preemptions": self.preemptions, "steps": self.steps, "end_s": self.end_s}


@dataclasses.dataclass
class Outcome:
    """A candidate's result: its capacity (max-rate search) and the point that decides it."""

    settings: Settings
    capacity: float | None  # requests/s meeting the target; None in the fixed-rate search
    point: Point | None  # at the capacity (or the given rate); None when no rate meets the target
    kv_bound: bool  # pages ran short at some rate tried
    same_as: Settings | None = None  # a smaller KV budget that gave the very same runs


def p99(values: list[float]) -> float:
    """The 99th percentile, interpolated linearly (numpy's default, as the load run's summary)."""
    return float(np.percentile(values, 99)) if values else 0.0


def sim_config(settings: Settings) -> SimConfig:
    """The engine the tuned TOML starts: async scheduling on, as `serve` defaults to (one stage, no
    draft model), so each step is planned while the one before computes."""
    return SimConfig(settings.policy, settings.max_num_seqs, settings.max_num_batched_tokens, settings.page_size,
                     settings.num_pages, async_scheduling=True)


def simulate_at(settings: Settings, workload: Workload, rate: float, model: CostModel) -> SimResult:
    """The simulated run of the workload at `rate`, each request with its times."""
    return simulate_arrivals(list(workload.lengths), workload.arrivals(rate), sim_config(settings),
                             model.pricer(settings.max_num_seqs, settings.max_num_batched_tokens))


def sensitivity(settings: Settings, workload: Workload, rate: float, model: CostModel, error: float) -> dict:
    """The p99s with every step `error` cheaper and dearer than priced. At the nominal capacity
    queueing starts: there the TTFT tail moves several times as much as the step cost (on the
    tuning workload, steps 3% dearer made the TTFT p99 22% longer, the TPOT p99 4%), so a prediction
    there is only as close as the step costs are on the machine as it runs; hence the cost margin
    under which `tune` recommends a rate."""
    runs = {f"{1 + sign * error:g}": simulate_at(settings, workload, rate, model.scaled(1 + sign * error))
            for sign in (-1, 1)}
    return {scale: {"ttft_p99_s": p99(r.ttft_s()), "tpot_p99_s": p99(r.tpot_s())} for scale, r in runs.items()}


def run_point(settings: Settings, workload: Workload, rate: float, model: CostModel) -> Point:
    result = simulate_at(settings, workload, rate, model)
    return Point(rate, p99(result.ttft_s()), p99(result.tpot_s()), result.num_preemptions, result.kv_bound,
                 result.num_steps, result.end_s)


def speed_of_run(settings: Settings, workload: Workload, rate: float, model: CostModel, steps: int) -> float | None:
    """The step-cost scale at which the simulation runs as many iterations as a measured run did:
    faster steps each carry fewer tokens, so a run's iteration count tells how fast the machine was
    while it ran against the measured step costs (on a shared machine the two drift apart). A
    gauge, not a measure: decode steps priced dear against prompt steps also batch more decodes and
    cut the count. By bisection on log(scale), between 1/2 and 2; None when the count lies outside
    what that range gives (the bisection would end on a bound and name it as the speed)."""
    bounds = low, high = 0.5, 2.0
    while high / low > 1.01:
        middle = math.sqrt(low * high)
        if simulate_at(settings, workload, rate, model.scaled(middle)).num_steps > steps:
            low = middle  # too many steps: the steps are dearer than that
        else:
            high = middle
    return None if low == bounds[0] or high == bounds[1] else math.sqrt(low * high)


def candidates(space: Space, workload: Workload, num_pages_for: Callable[[int], int], page_size: int
               ) -> tuple[list[Settings], list[tuple[str, str]]]:
    """The settings to simulate, and the refused ones as (description, reason). `num_pages_for(kv
    bytes)`: the memory plan's page count for that budget; it raises ConfigError to refuse it."""
    refused: list[tuple[str, str]] = []
    pages: dict[int, int] = {}
    for kv in sorted(space.kv_cache_memory):
        try:
            pages[kv] = num_pages_for(kv)
        except ConfigError as error:
            refused.append((f"kv={kv / 2**20:g}MiB", f"memory plan: {error}"))
            continue
        if pages[kv] * page_size < workload.max_request_len:
            refused.append((f"kv={kv / 2**20:g}MiB", f"holds {pages[kv] * page_size} tokens, less than the "
                                                    f"workload's longest request ({workload.max_request_len})"))
            del pages[kv]
    chosen = []
    for policy in space.policies:
        for seqs in sorted(space.max_num_seqs):
            for tokens in sorted(space.max_num_batched_tokens):
                label = f"{policy} seqs={seqs} tokens={tokens}"
                if tokens < seqs:
                    refused.append((label, "max_num_batched_tokens is below max_num_seqs (every running request "
                                           "must be able to decode in each step)"))
                    continue
                if policy != "chunked" and workload.max_prompt_len > tokens:
                    refused.append((label, f"the policy does not split prompts, and the longest prompt "
                                           f"({workload.max_prompt_len} tokens) exceeds the token budget"))
                    continue
                chosen += [Settings(policy, seqs, tokens, kv, n, page_size) for kv, n in pages.items()]
    return chosen, refused


def saturation_rate(settings: Settings, workload: Workload, model: CostModel) -> float:
    """Requests/s the settings complete with every request queued at once: no rate above it can be
    sustained, so the capacity bisection starts below it."""
    result = simulate_arrivals(list(workload.lengths), [0.0] * len(workload.lengths), sim_config(settings),
                               model.pricer(settings.max_num_seqs, settings.max_num_batched_tokens))
    return len(workload.lengths) / result.end_s


def find_capacity(settings: Settings, workload: Workload, model: CostModel, target: Target,
                  best: float = 0.0) -> Outcome:
    """The largest rate whose simulated p99s meet the target: by bisection on log(rate), between the
    rate the settings saturate at (all requests queued at once) and a quarter of it, or lower if
    needed. `best`, the best capacity found so far: a candidate that misses the target there cannot
    win, and its own capacity is found only to COARSE_RESOLUTION (for the table and the plot)."""
    points = []

    def meets(rate: float) -> bool:
        points.append(run_point(settings, workload, rate, model))
        return points[-1].meets(target)

    def outcome(capacity: float) -> Outcome:
        at = next((p for p in points if p.rate == capacity), None)
        return Outcome(settings, capacity, at, any(p.kv_bound for p in points))

    saturation = saturation_rate(settings, workload, model)
    high, low, resolution = 1.25 * saturation, None, RATE_RESOLUTION
    if meets(high):  # a loose target: any rate the server sustains meets it
        return outcome(high)
    if 0 < best < high:
        if meets(best):
            low = best  # it may beat the best: bisect above it, finely
        else:
            high, resolution = best, COARSE_RESOLUTION  # it cannot
    if low is None:
        low = high / 4
        while not meets(low):  # gallop down to a rate that meets the target
            high, low = low, low / 4
            if low < saturation / 1000:  # requests alone miss the target
                return Outcome(settings, 0.0, None, any(p.kv_bound for p in points))
    while high / low > 1 + resolution:
        middle = math.sqrt(low * high)
        if meets(middle):
            low = middle
        else:
            high = middle
    return outcome(low)


def _same_runs(outcome: Outcome, settings: Settings) -> Outcome:
    """A larger KV budget's outcome where the smaller one never ran short of pages."""
    return dataclasses.replace(outcome, settings=settings, same_as=outcome.same_as or outcome.settings)


def search(space: Space, workload: Workload, model: CostModel, target: Target, num_pages_for: Callable[[int], int],
           page_size: int, progress: Callable[[Iterable], Iterable] = lambda items: items
           ) -> tuple[Outcome | None, list[Outcome], list[tuple[str, str]]]:
    """The best settings (None if none meets the target), every candidate's outcome, and the refused
    settings with their reasons."""
    settings, refused = candidates(space, workload, num_pages_for, page_size)
    outcomes: list[Outcome] = []
    previous: Outcome | None = None  # the same policy and limits with the next smaller KV budget
    for s in progress(settings):
        same_limits = previous is not None and (previous.settings.policy, previous.settings.max_num_seqs,
                                                previous.settings.max_num_batched_tokens) == (
            s.policy, s.max_num_seqs, s.max_num_batched_tokens)
        if same_limits and not previous.kv_bound:
            outcome = _same_runs(previous, s)
        elif target.rate is not None:
            point = run_point(s, workload, target.rate, model)
            outcome = Outcome(s, None, point, point.kv_bound)
        else:
            outcome = find_capacity(s, workload, model, target, max((o.capacity or 0.0 for o in outcomes), default=0.0))
        outcomes.append(outcome)
        previous = outcome
    return choose(outcomes, workload, model, target), outcomes, refused


def choose(outcomes: list[Outcome], workload: Workload, model: CostModel, target: Target) -> Outcome | None:
    """The winner under the module docstring's objective."""
    if target.rate is not None:
        feasible = [o for o in outcomes if o.point is not None]
        return min(feasible, key=lambda o: (o.point.score(target), o.settings.kv_cache_memory), default=None)
    feasible = [o for o in outcomes if o.capacity]
    if not feasible:
        return None
    best = max(o.capacity for o in feasible)
    common = best / (1 + RATE_RESOLUTION)
    tied = [o for o in feasible if o.capacity >= common]
    scores = {}
    for o in tied:  # their headroom at one rate they all meet
        key = o.same_as or o.settings
        if key not in scores:
            scores[key] = run_point(key, workload, common, model).score(target)
    return min(tied, key=lambda o: (scores[o.same_as or o.settings], o.settings.kv_cache_memory))
