"""Runners are compiled once per session and shared: the scheduling policy lives in the engine, so
one runner (one set of compiled buckets) serves engines of every policy."""

import pytest

from orca_jax.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.engine.runner import Buckets, ModelRunner

TINY_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)
SMOLLM2_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128)


def warm_tiny_runner(tiny_trained, attention_impl):
    runner = ModelRunner(tiny_trained.model, num_pages=160, page_size=4, max_model_len=128,
                         buckets=Buckets(tokens=(16, 64), seqs=(4, 8)), attention_impl=attention_impl,
                         parallel=ParallelConfig())
    runner.warm_up(show_progress=False)
    return runner


@pytest.fixture(scope="session")
def tiny_runner(tiny_trained):
    return warm_tiny_runner(tiny_trained, "xla")


@pytest.fixture(scope="session")
def tiny_pallas_runner(tiny_trained):
    """The same runner with the Pallas kernel, run in interpret mode (CPU)."""
    return warm_tiny_runner(tiny_trained, "pallas-interpret")


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    runner = ModelRunner(smollm2.model, num_pages=96, page_size=16, max_model_len=2048,
                         buckets=Buckets(tokens=(32, 128), seqs=(8,)), attention_impl="xla",
                         parallel=ParallelConfig())
    runner.warm_up(show_progress=False)
    return runner


def make_engine(runner, loaded, policy, *, prefix_caching=False, max_num_seqs, max_num_batched_tokens):
    config = EngineConfig(
        model=str(loaded.path),
        cache=CacheConfig(page_size=runner.page_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens),
    )
    return LLMEngine(config, loaded.config, runner, loaded.tokenizer, max_model_len=runner.max_pages_per_seq * runner.page_size)


def run_all(engine, requests):
    """requests: [(prompt_token_ids, SamplingParams)] -> RequestOutputs in order."""
    ids = [engine.add_request(list(p), params) for p, params in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.kv.num_free_pages == engine.kv.num_pages  # every page came back
    return [done[i] for i in ids]
