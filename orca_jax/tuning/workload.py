"""Workloads as lengths and arrival times: what the simulation needs, and what a load run replays.

A workload is a list of requests (prompt token ids, max_tokens, arrival offset). It is described by
a `WorkloadSpec` (length distributions, arrival process, seed) and can be saved to / loaded from
JSONL, one request per line, so a run can be repeated exactly or replayed against a server.
(bench/workloads.py builds prompts from real text on top of this.)

Length distributions, each over an inclusive range [lo, hi]:
  uniform  every length in the range equally likely;
  zipf     heavy-tailed: a bounded Pareto (power law, exponent `alpha`) truncated at hi, so most
           requests are short and a few are long -- the case where request-level batching waits
           for its longest member and iteration-level scheduling gains most;
  equal    every request gets hi -- the case where iteration-level scheduling should gain little.

Arrival processes: `all` (every request at t=0, the offline case), `poisson` (exponential gaps at
`rate` requests/s) and `gamma` (gamma-distributed gaps with the same mean and a coefficient of
variation `cv`: cv > 1 is burstier than Poisson, cv = 1 is Poisson).

The lengths and the arrivals come from separate seeded streams, so changing the arrival process
keeps the same requests.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

LENGTH_DISTRIBUTIONS = ("uniform", "zipf", "equal")
ARRIVAL_PROCESSES = ("all", "poisson", "gamma")


@dataclasses.dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run
    prompt: str | None = None  # the prompt as text, for clients that send text (a server bench)


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 48
    prompt_dist: str = "uniform"
    prompt_len: tuple[int, int] = (32, 192)  # tokens, inclusive range
    output_dist: str = "zipf"
    output_len: tuple[int, int] = (8, 128)  # generated tokens (max_tokens; run with ignore_eos to get exactly these)
    zipf_alpha: float = 1.0  # power-law exponent of the `zipf` distribution; smaller = heavier tail
    shared_prefix: int = 0  # tokens every prompt starts with (a system prompt), counted in its length
    arrival: str = "all"
    rate: float = 4.0  # requests/s, for poisson and gamma arrivals
    cv: float = 2.0  # gamma arrivals: coefficient of variation of the gaps (1 = Poisson)
    seed: int = 0

    def __post_init__(self):
        for name in ("prompt_dist", "output_dist"):
            if getattr(self, name) not in LENGTH_DISTRIBUTIONS:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {LENGTH_DISTRIBUTIONS}")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}={getattr(self, name)}; need 1 <= lo <= hi")
        if self.arrival not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival={self.arrival!r}; choose one of {ARRIVAL_PROCESSES}")
        if not 0 <= self.shared_prefix < self.prompt_len[0]:
            raise ValueError(f"shared_prefix={self.shared_prefix} must be below the shortest prompt ({self.prompt_len[0]})")
        if self.num_requests < 1 or self.rate <= 0 or self.cv <= 0 or self.zipf_alpha <= 0:
            raise ValueError("need num_requests >= 1 and rate, cv, zipf_alpha > 0")


def sample_length(rng: random.Random, dist: str, lo: int, hi: int, alpha: float) -> int:
    if dist == "equal":
        return hi
    if dist == "uniform":
        return rng.randint(lo, hi)
    # Bounded Pareto on [lo, hi + 1) by inverting its CDF, floored to an integer in [lo, hi].
    low, high = lo, hi + 1
    u = rng.random()
    x = low / (1 - u * (1 - (low / high) ** alpha)) ** (1 / alpha)
    return min(hi, int(x))


def sample_lengths(spec: WorkloadSpec) -> list[tuple[int, int]]:
    """(prompt_len, max_tokens) per request."""
    rng = random.Random(f"lengths-{spec.seed}")
    return [(sample_length(rng, spec.prompt_dist, *spec.prompt_len, spec.zipf_alpha),
             sample_length(rng, spec.output_dist, *spec.output_len, spec.zipf_alpha))
            for _ in range(spec.num_requests)]


def sample_arrivals(spec: WorkloadSpec) -> list[float]:
    """Arrival offsets in seconds, non-decreasing, the first at 0."""
    if spec.arrival == "all":
        return [0.0] * spec.num_requests
    rng = random.Random(f"arrivals-{spec.seed}")
    if spec.arrival == "poisson":
        gaps = [rng.expovariate(spec.rate) for _ in range(spec.num_requests - 1)]
    else:
        shape = 1 / spec.cv ** 2  # gamma(shape k, scale 1/(rate k)): mean 1/rate, CV 1/sqrt(k)
        gaps = [rng.gammavariate(shape, 1 / (spec.rate * shape)) for _ in range(spec.num_requests - 1)]
    arrivals = [0.0]
    for gap in gaps:
        arrivals.append(arrivals[-1] + gap)
    return arrivals


def save_jsonl(requests: list[WorkloadRequest], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")


def load_jsonl(path: Path) -> list[WorkloadRequest]:
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"prompt_token_ids", "max_tokens"} - row.keys()
        if missing:
            raise ValueError(f"{path}:{number}: missing {sorted(missing)}")
        requests.append(WorkloadRequest(list(row["prompt_token_ids"]), int(row["max_tokens"]),
                                        float(row.get("arrival_s", 0.0)), row.get("prompt")))
    return requests


def workload_lengths(requests: list[WorkloadRequest]) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.max_tokens) for r in requests]


def describe(lengths: list[tuple[int, int]]) -> str:
    prompts = sorted(p for p, _ in lengths)
    outputs = sorted(o for _, o in lengths)
    def summary(xs):
        return f"mean {sum(xs) / len(xs):.0f}, p50 {xs[len(xs) // 2]}, max {xs[-1]}"
    return f"{len(lengths)} requests; prompt {summary(prompts)}; output {summary(outputs)}"


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the tuner prices: each request's (prompt_len, max_tokens) and its arrival offset at a
    mean rate of one request per second; `arrivals(rate)` stretches those offsets to another rate."""

    lengths: tuple[tuple[int, int], ...]
    unit_arrivals: tuple[float, ...]
    prompt_token_ids: tuple[tuple[int, ...], ...] | None = None  # a file's own prompts, to replay as they are

    def __post_init__(self):
        if not self.lengths or len(self.unit_arrivals) != len(self.lengths):
            raise ValueError("a workload needs at least one request and one arrival offset per request")

    def arrivals(self, rate: float) -> list[float]:
        return [a / rate for a in self.unit_arrivals]

    @property
    def max_prompt_len(self) -> int:
        return max(p for p, _ in self.lengths)

    @property
    def max_request_len(self) -> int:
        return max(p + o for p, o in self.lengths)


def workload_of_spec(spec: WorkloadSpec) -> Workload:
    """The spec's lengths, and its arrival process (poisson, or gamma with its cv) at one request/s;
    `all` arrivals become Poisson, since the tuner prices a stream of requests."""
    arrival = "poisson" if spec.arrival == "all" else spec.arrival
    arrivals = sample_arrivals(dataclasses.replace(spec, arrival=arrival, rate=1.0))
    return Workload(tuple(sample_lengths(spec)), tuple(arrivals))


def workload_of_requests(requests: list[WorkloadRequest], seed: int = 0) -> Workload:
    """A JSONL workload's requests, replayed with their own prompts. Their arrival offsets, scaled to
    one request/s, give the arrival pattern; a file without any (all at 0) gets Poisson arrivals."""
    if not requests:
        raise ValueError("the workload has no requests")
    offsets = [r.arrival_s for r in requests]
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError("the workload's arrival_s offsets must be non-decreasing")
    span = offsets[-1] - offsets[0]
    if span > 0 and len(requests) > 1:
        per_second = (len(requests) - 1) / span
        unit = tuple((a - offsets[0]) * per_second for a in offsets)
    else:
        unit = tuple(sample_arrivals(WorkloadSpec(num_requests=len(requests), arrival="poisson", rate=1.0, seed=seed)))
    return Workload(tuple(workload_lengths(requests)), unit, tuple(tuple(r.prompt_token_ids) for r in requests))
