"""Seeded, reproducible benchmark workloads built from real text that ships with Python.

A workload is a list of requests (prompt token ids, max_tokens, arrival offset). It is described by
a `WorkloadSpec` (length distributions, arrival process, seed) and can be saved to / loaded from
JSONL, one request per line, so a run can be repeated exactly or replayed against a server.

Prompts are cut from the docstrings of standard-library modules (English prose and code, no
downloads), tokenized by the model's own tokenizer, to exact token lengths.

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
import importlib
import json
import random
import warnings
from pathlib import Path

TEXT_MODULES = ["argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email",
                "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random",
                "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
                "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile"]
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


# ---- lengths and arrivals (no tokenizer needed: the simulation works on these alone) ------------

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


# ---- prompts from real text -----------------------------------------------------------------

def corpus_text() -> str:
    """Standard-library documentation: module docstrings and those of their public callables."""
    texts = []
    with warnings.catch_warnings():  # reading typing.io / typing.re warns that they are deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in TEXT_MODULES:
            module = importlib.import_module(name)
            texts += [module.__doc__ or ""] + [getattr(module, a).__doc__ or "" for a in sorted(vars(module))
                                               if not a.startswith("_") and callable(getattr(module, a))][:40]
    return "\n\n".join(t for t in texts if t)


def corpus_token_ids(tokenizer) -> list[int]:
    """One long token stream of standard-library documentation."""
    return tokenizer.encode(corpus_text())


def build_workload(tokenizer, spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of `spec`: each prompt the shared prefix (if any) then a random cut of the corpus,
    of exactly the sampled length, with its text (decoded from those ids) for clients that send text."""
    corpus = corpus_token_ids(tokenizer)
    rng = random.Random(f"prompts-{spec.seed}")
    if spec.prompt_len[1] >= len(corpus):
        raise ValueError(f"prompts of up to {spec.prompt_len[1]} tokens need a longer corpus ({len(corpus)} tokens)")
    prefix_start = rng.randrange(0, len(corpus) - spec.shared_prefix)
    prefix = corpus[prefix_start:prefix_start + spec.shared_prefix]
    requests = []
    for (prompt_len, max_tokens), arrival in zip(sample_lengths(spec), sample_arrivals(spec)):
        n = prompt_len - len(prefix)
        start = rng.randrange(0, len(corpus) - n)
        ids = prefix + corpus[start:start + n]
        requests.append(WorkloadRequest(ids, max_tokens, arrival, tokenizer.decode(ids)))
    return requests


def mixed_workload(tokenizer, num_requests: int = 64, seed: int = 0) -> list[WorkloadRequest]:
    """bench_throughput.py's workload (the engine issue's benchmark): named_spec's `throughput` kind."""
    return build_workload(tokenizer, named_spec("throughput", num_requests, seed))


# ---- named workloads of the scheduling bench -------------------------------------------------

def named_spec(kind: str, num_requests: int, seed: int = 0, **overrides) -> WorkloadSpec:
    """The benches' workload kinds, all arriving at once, prompts uniform in [32, 192]:
    heavy-tailed outputs (`zipf`), uniform outputs (`uniform`), or every request alike (`equal`:
    prompt 112 and 64 outputs, near the other two's mean work per request); and bench_throughput.py's
    (`throughput`: prompts uniform in [100, 300], outputs uniform in [8, 256]), so a server can be
    driven with the same requests (`bench serving --workload throughput --num-requests 64`)."""
    kinds = {
        "zipf": dict(output_dist="zipf", output_len=(8, 128)),
        "uniform": dict(output_dist="uniform", output_len=(8, 96)),
        "equal": dict(prompt_dist="equal", prompt_len=(112, 112), output_dist="equal", output_len=(64, 64)),
        "throughput": dict(prompt_len=(100, 300), output_dist="uniform", output_len=(8, 256)),
    }
    if kind not in kinds:
        raise ValueError(f"workload kind {kind!r}; choose one of {sorted(kinds)}")
    return WorkloadSpec(num_requests=num_requests, seed=seed, **{**kinds[kind], **overrides})


# ---- JSONL -------------------------------------------------------------------------------

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


# ---- copy-heavy workload of the speculative-decoding bench -------------------------------------

COPY_TASKS = ("edit code", "correct text", "extract fields")
FIRST_NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "John", "Margaret", "Niklaus"]
LAST_NAMES = ["Lovelace", "Turing", "Hopper", "Dijkstra", "Liskov", "Knuth", "Allen", "Backus", "Hamilton", "Wirth"]
CITIES = ["London", "Manchester", "New York", "Rotterdam", "Boston", "Stanford", "Zurich", "Cambridge"]


def small_functions(max_lines: int = 14) -> list[str]:
    """Sources of short standard-library Python functions (the code to edit)."""
    import inspect

    sources = []
    for name in ["textwrap", "string", "heapq", "statistics", "shutil", "json.encoder", "calendar", "fnmatch"]:
        module = importlib.import_module(name)
        for _, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(function)
            except (OSError, TypeError):
                continue
            if 4 <= source.count("\n") <= max_lines:
                sources.append(source.rstrip())
    return sources


def with_typos(text: str, rng: random.Random, rate: float = 0.15) -> str:
    """Swaps two inner letters in about `rate` of the words longer than three letters."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) > 3 and word.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def copy_heavy_workload(tokenizer, num_requests: int = 12, seed: int = 0, max_tokens: int = 160) -> list[WorkloadRequest]:
    """Requests whose answers repeat much of their prompt (speculative decoding's best case, as in
    real use: edit this code, correct this text, extract these fields), as chat prompts, taking
    turns between the three kinds."""
    rng = random.Random(seed)
    functions = small_functions()
    paragraphs = [p.strip().replace("\n", " ") for p in corpus_text().split("\n\n") if 200 < len(p.strip()) < 500]
    requests = []
    for i in range(num_requests):
        kind = COPY_TASKS[i % len(COPY_TASKS)]
        if kind == "edit code":
            content = f"Add a docstring to this Python function. Write out the whole function:\n```python\n{rng.choice(functions)}\n```"
        elif kind == "correct text":
            content = "Rewrite this text with its spelling mistakes fixed:\n\n" + with_typos(rng.choice(paragraphs), rng)
        else:
            people = [(rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES), rng.choice(CITIES)) for _ in range(6)]
            records = "\n".join(f"- {first} {last} (id {rng.randrange(1000, 9999)}) lives in {city} and works as an "
                                f"engineer; email {first.lower()}.{last.lower()}@example.com"
                                for first, last, city in people)
            content = ("For each person below, write one line `name, email, city`, nothing else:\n" + records)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        requests.append(WorkloadRequest(tokenizer.encode(prompt), max_tokens, prompt=prompt))
    return requests
