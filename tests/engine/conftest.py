"""Engines over the session's shared runners (tests/conftest.py): the scheduling policy lives in the
engine, so one runner (one set of compiled buckets) serves engines of every policy."""

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine.engine import LLMEngine

TINY_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)
SMOLLM2_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128)


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
