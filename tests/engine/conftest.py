"""Engines over the session's shared runners (tests/conftest.py): the scheduling policy lives in the
engine, so one runner (one set of compiled buckets) serves engines of every policy."""

import dataclasses

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.engine.engine import LLMEngine

TINY_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64)
SMOLLM2_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=128)


def make_engine(runner, loaded, policy, *, prefix_caching=False, max_num_seqs, max_num_batched_tokens,
                speculative_config=None, async_scheduling=True):
    """`speculative_config` needs a speculating runner (tests/conftest.py's *_spec_runner)."""
    config = EngineConfig(
        model=str(loaded.path),
        cache=CacheConfig(page_size=runner.page_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling),
        speculative_config=speculative_config,
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


def speculating_equals_plain(plain_runner, spec_runner, loaded, policy, requests, speculative_config, limits):
    """Runs `requests` without speculation and with it; asserts every output (tokens and finish
    reason) is the same. Returns the speculating engine and the schedules it ran."""
    from .mock_runner import record_schedules

    off = run_all(make_engine(plain_runner, loaded, policy, **limits), requests)
    engine = make_engine(spec_runner, loaded, policy, **limits, speculative_config=speculative_config)
    schedules = record_schedules(engine)
    on = run_all(engine, requests)
    for a, b in zip(off, on, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    return engine, schedules


# What batching guarantees (docs/numerics.md). The XLA:CPU matmul sums its products in an
# order that depends on how many rows a call has, so a request's numbers differ with the batch it
# rides in by rounding: float32 logprobs moved by at most 4.3e-5 nats on SmolLM2 (measured), which
# leaves greedy tokens identical; bfloat16 rounds each activation to 8 bits, which turns the same
# differences into up to 0.35 nats (measured), so a greedy path may part where two tokens were that
# close; with only the KV pages in bfloat16 (float32 activations) 0.008 nats were measured.
FLOAT32_MAX_DRIFT = 1e-3  # nats
BFLOAT16_MAX_DRIFT = 0.5  # nats
BFLOAT16_PAGES_MAX_DRIFT = 0.05  # nats


def greedy_with_logprobs(max_tokens):
    from orca_jax.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)


def diverging_requests(batched, solo, *, max_drift: float) -> list[int]:
    """Checks each batched greedy request (run with logprobs >= 2) against its solo run: it follows
    the solo path with every chosen token's logprob within `max_drift` nats of solo's, and leaves
    it, if at all, only at a near-tie: for a token solo ranked within `max_drift` of its own pick.
    Returns the indices of the requests that left their path."""
    diverged = []
    for index, (b, s) in enumerate(zip(batched, solo)):
        b, s = b.outputs[0], s.outputs[0]
        for k, (b_token, s_token) in enumerate(zip(b.token_ids, s.token_ids)):
            if b_token != s_token:
                assert b_token in s.logprobs[k], (index, k, b_token, s.logprobs[k])
                gap = s.logprobs[k][s_token].logprob - s.logprobs[k][b_token].logprob
                assert gap <= max_drift, (index, k, b_token, s_token, gap)
                diverged.append(index)
                break
            drift = abs(b.logprobs[k][b_token].logprob - s.logprobs[k][s_token].logprob)
            assert drift <= max_drift, (index, k, b_token, drift)
        else:
            assert len(b.token_ids) == len(s.token_ids), index
    return diverged


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """How far a batched request may stray from its solo run. Requests that asked for logprobs
    (greedy ones) have each chosen token's logprob within `max_drift` nats of solo's. Without
    `near_ties` every request gives its solo tokens and finish reason; with it (bfloat16), up to a
    third of them may leave their solo path at a near-tie (diverging_requests; every request must
    then ask for logprobs)."""

    max_drift: float = FLOAT32_MAX_DRIFT
    near_ties: bool = False


EQUAL = Tolerance()  # float32: the same tokens, logprobs equal up to rounding


def run_solo(new_engine, requests) -> list:
    """Each of `requests` ([(prompt_token_ids, SamplingParams)]) alone, on an engine of its own
    from `new_engine()`."""
    return [run_all(new_engine(), [request])[0] for request in requests]


def check_batched_equals_solo(engine, requests, solo, tolerance: Tolerance = EQUAL) -> list:
    """Batched == solo (docs/numerics.md, "Batch invariance"; test_batched_equals_solo.py runs it over
    every runner): runs `requests` together on `engine` and holds each output to `solo`, its solo
    run, within `tolerance`. Returns the batched outputs."""
    batched = run_all(engine, requests)
    assert engine.num_steps < sum(len(o.outputs[0].token_ids) for o in solo)  # requests did share steps
    if tolerance.near_ties:
        diverged = diverging_requests(batched, solo, max_drift=tolerance.max_drift)
        assert len(diverged) <= len(requests) // 3, diverged  # near-ties are rare: measured 0 to 2 of 9
        return batched
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in solo]
    assert [o.outputs[0].finish_reason for o in batched] == [o.outputs[0].finish_reason for o in solo]
    with_logprobs = [i for i, (_, params) in enumerate(requests) if params.logprobs]
    assert diverging_requests([batched[i] for i in with_logprobs], [solo[i] for i in with_logprobs],
                              max_drift=tolerance.max_drift) == []
    return batched
