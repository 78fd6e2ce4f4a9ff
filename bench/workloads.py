"""Seeded, reproducible benchmark workloads built from real text that ships with Python.

A workload is a list of requests (prompt token ids, max_tokens, arrival offset), described by a
`WorkloadSpec`: its lengths, arrivals and JSONL form live in the package (orca_jax/tuning/workload.py,
re-exported here), so `orca-jax tune` can use them installed. This file adds the prompts.

Prompts are cut from the docstrings of standard-library modules (English prose and code, no
downloads), tokenized by the model's own tokenizer, to exact token lengths.
"""

from __future__ import annotations

import importlib
import random
import warnings

from orca_jax.tuning.workload import (  # noqa: F401 (re-exported for the bench scripts)
    ARRIVAL_PROCESSES,
    LENGTH_DISTRIBUTIONS,
    WorkloadRequest,
    WorkloadSpec,
    describe,
    load_jsonl,
    sample_arrivals,
    sample_length,
    sample_lengths,
    save_jsonl,
    workload_lengths,
)

TEXT_MODULES = ["argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email",
                "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random",
                "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
                "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile"]


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
