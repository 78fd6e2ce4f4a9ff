"""A fifth scheduling policy enters through the scheduler's registry and the config's choice list
alone: the engine asks its scheduler the policy's questions and never names a policy."""

import pytest

from orca_jax import config
from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.engine import scheduler
from orca_jax.sampling_params import SamplingParams

from .conftest import TINY_LIMITS, make_engine, run_all
from .test_engine_tiny import workload


class LongestFirst(scheduler.Scheduler):
    """Test-only: prompts in chunks, and the running request with the most computed tokens claims
    the token budget first."""

    chunks_prompts = True

    def _running_order(self):
        return sorted(self.running, key=lambda r: -r.num_computed_tokens)


@pytest.fixture
def longest_first(monkeypatch):
    monkeypatch.setitem(scheduler.POLICIES, "longest-first", LongestFirst)
    monkeypatch.setattr(config, "SCHEDULING_POLICIES", (*config.SCHEDULING_POLICIES, "longest-first"))


def test_every_configured_policy_has_a_scheduler():
    assert set(scheduler.POLICIES) == set(config.SCHEDULING_POLICIES)


def test_a_fifth_policy_runs_end_to_end_through_the_engine(longest_first, tiny_runner, tiny_trained):
    # Two sentences, 70 tokens: longer than the 64-token budget, so only a chunking policy admits it.
    long_prompt = counting_sequence(0, 1) + counting_sequence(20, 1)[:4]
    assert len(long_prompt) > TINY_LIMITS["max_num_batched_tokens"]
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in workload()]
    requests.append((long_prompt, SamplingParams(temperature=0.0, max_tokens=8)))
    engine = make_engine(tiny_runner, tiny_trained, "longest-first", **TINY_LIMITS)
    assert isinstance(engine.scheduler, LongestFirst)
    outputs = run_all(engine, requests)  # also checks that every page came back
    reference = run_all(make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS), requests)
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert tiny_runner.num_compilations_after_warmup == 0
