"""Seeded, reproducible benchmark workloads built from real text that ships with Python.

Prompts are cut from the docstrings of standard-library modules (English prose and code, no
downloads), tokenized by the model's own tokenizer, to exact token lengths.
"""

from __future__ import annotations

import dataclasses
import importlib
import random

TEXT_MODULES = ["argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email",
                "functools", "heapq", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "random",
                "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "textwrap",
                "threading", "typing", "unittest", "urllib.parse", "uuid", "zipfile"]


@dataclasses.dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run


def corpus_token_ids(tokenizer) -> list[int]:
    """One long token stream of standard-library documentation."""
    texts = []
    for name in TEXT_MODULES:
        module = importlib.import_module(name)
        texts += [module.__doc__ or ""] + [getattr(module, a).__doc__ or "" for a in sorted(vars(module))
                                           if not a.startswith("_") and callable(getattr(module, a))][:40]
    return tokenizer.encode("\n\n".join(t for t in texts if t))


def mixed_workload(tokenizer, num_requests: int = 64, prompt_len: tuple[int, int] = (100, 300),
                   output_len: tuple[int, int] = (8, 256), seed: int = 0) -> list[WorkloadRequest]:
    """Uniform prompt and output lengths, all arriving at once (the engine issue's benchmark)."""
    rng = random.Random(seed)
    corpus = corpus_token_ids(tokenizer)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        start = rng.randrange(0, len(corpus) - n)
        requests.append(WorkloadRequest(corpus[start:start + n], rng.randint(*output_len)))
    return requests

