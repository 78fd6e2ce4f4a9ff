"""The simulation with arrival times and step costs (orca_jax/tuning/simulate.py): requests join the
queue when they arrive, the engine idles until the next one, and each request's first and last
tokens are stamped when their step ends -- held to the real engine (mock runner) step by step, and
to hand-computed latencies."""

import dataclasses
import random

import pytest

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.engine.engine import LLMEngine
from orca_jax.sampling_params import SamplingParams
from orca_jax.tuning.simulate import POLICIES, SimConfig, SimStep, simulate_arrivals
from orca_jax.tuning.workload import WorkloadSpec, sample_arrivals, sample_lengths

from ..engine.mock_runner import MockRunner, record_schedules

VOCAB = 1000
MODEL = dataclasses.replace(load_model_preset("tiny"), vocab_size=VOCAB, eos_token_id=None, max_position=4096)


def add_arrived(engine, lengths, arrivals, added: int, now: float, rng: random.Random) -> int:
    """Adds the requests that have arrived by `now` (random prompts of their lengths, greedy, exactly
    their max_tokens); returns how many have been added in all."""
    while added < len(lengths) and arrivals[added] <= now:
        prompt_len, max_tokens = lengths[added]
        engine.add_request([rng.randrange(VOCAB) for _ in range(prompt_len)],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           request_id=str(added))
        added += 1
    return added


def step_cost(step: SimStep) -> float:
    """Any deterministic function of the step's shape: a prompt token costs more than a decode."""
    return 0.01 + 0.002 * len(step.chunks) + 0.0005 * sum(n for _, n in step.chunks if n > 1)


def engine_run(lengths, arrivals, policy, max_num_seqs, max_num_batched_tokens, page_size, num_pages):
    """The engine stepped one iteration at a time on the same clock as the simulation: before each
    step, the requests that arrived by now are added; with nothing to do, time jumps to the next."""
    config = EngineConfig(model="mock", cache=CacheConfig(page_size=page_size),
                          scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens,
                                                    async_scheduling=False))
    runner = MockRunner(num_pages, page_size, VOCAB, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    schedules = record_schedules(engine)
    rng = random.Random(1)
    clock, added, first_token, done = 0.0, 0, {}, {}
    while added < len(lengths) or engine.has_unfinished_requests():
        added = add_arrived(engine, lengths, arrivals, added, clock, rng)
        if not engine.has_unfinished_requests():
            clock = arrivals[added]
            continue
        before = len(schedules)
        outputs = engine.step()
        if len(schedules) > before:
            out = schedules[-1]
            clock += step_cost(SimStep(tuple((p.start, p.num_new_tokens) for p in out.scheduled),
                                       out.num_padding_seqs))
        for output in outputs:
            if output.outputs[0].token_ids:
                first_token.setdefault(output.request_id, clock)
            if output.finished:
                done[output.request_id] = clock
    steps = [(tuple((p.start, p.num_new_tokens) for p in out.scheduled), out.num_padding_seqs) for out in schedules]
    return steps, first_token, done


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_arrivals_match_the_engine_step_by_step_and_token_by_token(policy, seed):
    spec = WorkloadSpec(num_requests=30, prompt_len=(1, 40), output_dist="zipf", output_len=(1, 50),
                        arrival="poisson", rate=[8.0, 25.0, 60.0][seed], seed=seed)
    lengths, arrivals = sample_lengths(spec), sample_arrivals(spec)
    limits = (6, 48, 4, 16)  # seqs, token budget, page size, pages: tight enough to preempt
    steps, first_token, done = engine_run(lengths, arrivals, policy, *limits)
    result = simulate_arrivals(lengths, arrivals, SimConfig(policy, *limits), step_cost)
    assert [(s.chunks, s.num_padding_seqs) for s in result.steps] == steps
    for r in result.requests:
        assert r.first_token_s == pytest.approx(first_token[str(r.index)])
        assert r.finish_s == pytest.approx(done[str(r.index)])


def test_the_arrival_cases_exercise_idling_queueing_and_preemption():
    """Guards the test above against a regime too gentle to test anything."""
    spec = WorkloadSpec(num_requests=30, prompt_len=(1, 40), output_dist="zipf", output_len=(1, 50),
                        arrival="poisson", rate=60.0, seed=2)
    result = simulate_arrivals(sample_lengths(spec), sample_arrivals(spec), SimConfig("paged", 6, 48, 4, 16), step_cost)
    assert result.num_preemptions > 0 and result.kv_bound  # paged, seed 2: 1 (chunked: 4)
    assert max(result.ttft_s()) > 5 * min(result.ttft_s())  # some requests queued
    sparse = dataclasses.replace(spec, rate=0.5)
    idle = simulate_arrivals(sample_lengths(sparse), sample_arrivals(sparse), SimConfig("paged", 6, 48, 4, 16), step_cost)
    assert idle.end_s > sum(step_cost(s) for s in idle.steps) + 10  # it waited for arrivals


def test_latencies_by_hand():
    """Two requests, far apart: each alone, its prompt step then its decodes. Then the same two at
    once under static: both tokens streams are released when the batch ends."""
    cost = lambda step: 1.0 if any(n > 1 for _, n in step.chunks) else 0.1  # noqa: E731
    config = SimConfig("orca", 4, 64, 4, 100)
    result = simulate_arrivals([(10, 3), (5, 1)], [0.0, 100.0], config, cost)
    assert result.ttft_s() == pytest.approx([1.0, 1.0])
    assert result.tpot_s() == pytest.approx([0.1])  # the one-token request has no time per output token
    assert result.end_s == pytest.approx(101.0)
    static = simulate_arrivals([(10, 3), (5, 1)], [0.0, 0.0], dataclasses.replace(config, policy="static"), cost)
    assert static.ttft_s() == pytest.approx([1.2, 1.2])  # one prompt step (both prompts), two decodes
    assert static.tpot_s() == [0.0]


def test_bad_arrivals_are_refused():
    config = SimConfig("orca", 4, 64, 4, 100)
    with pytest.raises(ValueError, match="one arrival time per request"):
        simulate_arrivals([(10, 3), (5, 1)], [1.0, 0.0], config, step_cost)
    with pytest.raises(ValueError, match="exceed the KV cache"):
        simulate_arrivals([(300, 300)], [0.0], config, step_cost)


def async_engine_run(lengths, arrivals, policy, max_num_seqs, max_num_batched_tokens, page_size, num_pages):
    """The engine with async scheduling, driven as AsyncLLMEngine's thread drives it (add what has
    arrived, then step) on a virtual clock: a dispatched step runs on the device once the step
    before it is done, taking step_cost; collecting waits for its end. Host work takes no time."""
    config = EngineConfig(model="mock", cache=CacheConfig(page_size=page_size),
                          scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs,
                                                    max_num_batched_tokens=max_num_batched_tokens))
    runner = MockRunner(num_pages, page_size, VOCAB, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, feeds_sampled_tokens=True)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    assert engine.in_flight.plans_ahead
    schedules = record_schedules(engine)
    clock = {"host": 0.0, "device": 0.0}
    ends = []  # of the steps in flight, oldest first
    dispatch, collect = runner.dispatch, runner.collect

    def timed_dispatch(plan):
        out = schedules[-1]  # the plan being dispatched
        cost = step_cost(SimStep(tuple((p.start, p.num_new_tokens) for p in out.scheduled), out.num_padding_seqs))
        clock["device"] = max(clock["host"], clock["device"]) + cost
        ends.append(clock["device"])
        return dispatch(plan)

    def timed_collect(pending):
        clock["host"] = max(clock["host"], ends.pop(0))
        return collect(pending)

    runner.dispatch, runner.collect = timed_dispatch, timed_collect
    rng = random.Random(1)
    added, first_token, done = 0, {}, {}
    while added < len(lengths) or engine.has_unfinished_requests():
        added = add_arrived(engine, lengths, arrivals, added, clock["host"], rng)
        if not engine.has_unfinished_requests():
            clock["host"] = arrivals[added]
            continue
        for output in engine.step():
            if output.outputs[0].token_ids:
                first_token.setdefault(output.request_id, clock["host"])
            if output.finished:
                done[output.request_id] = clock["host"]
    steps = [(tuple((p.start, p.num_new_tokens) for p in out.scheduled), out.num_padding_seqs) for out in schedules]
    return steps, first_token, done


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_async_scheduling_matches_the_engine_planning_ahead(policy, seed):
    """With async scheduling the engine plans each step before the one in flight returns: admissions
    and freed pages come a step later, and prompt chunks hold the plan back. The simulation with
    async_scheduling runs the same steps and releases every token at the same time."""
    spec = WorkloadSpec(num_requests=30, prompt_len=(1, 40), output_dist="zipf", output_len=(1, 50),
                        arrival="poisson", rate=[8.0, 25.0, 60.0][seed], seed=seed)
    lengths, arrivals = sample_lengths(spec), sample_arrivals(spec)
    limits = (6, 48, 4, 16)  # seqs, token budget, page size, pages: chunked preempts at seed 2
    steps, first_token, done = async_engine_run(lengths, arrivals, policy, *limits)
    result = simulate_arrivals(lengths, arrivals, SimConfig(policy, *limits, async_scheduling=True), step_cost)
    if (policy, seed) == ("chunked", 2):  # a victim chosen with a step in flight is held to the engine too
        assert result.num_preemptions > 0
    assert [(s.chunks, s.num_padding_seqs) for s in result.steps] == steps
    for r in result.requests:
        assert r.first_token_s == pytest.approx(first_token[str(r.index)])
        assert r.finish_s == pytest.approx(done[str(r.index)])
    # It is not the engine stepping one at a time: the plans differ.
    assert simulate_arrivals(lengths, arrivals, SimConfig(policy, *limits), step_cost).steps != result.steps \
        or policy == "static"
