"""Batches in flight (pipeline parallelism) through the engine, with a mock runner that holds up to
two dispatched steps and refuses a request that is already in one (tests/engine/mock_runner.py).
Every policy's outputs at depth 2 are checked in test_scheduler.py."""

import dataclasses

import pytest

from orca_jax.sampling_params import SamplingParams

from .test_scheduler import VOCAB, abort_spares_the_others, expected_output, make_engine, run


def pipelined_engine(policy, **limits):
    return make_engine(policy, depth=limits.pop("depth", 2), **limits)


def test_each_step_takes_its_share_of_the_running_requests():
    """Orca's batches for n workers: 4 running requests over a 2-deep pipeline make two steps of 2,
    which take turns; neither holds a request the other holds (the mock asserts that)."""
    engine = pipelined_engine("orca", max_num_seqs=4)
    run(engine, [([1, 2, 3], 6) for _ in range(4)])
    plans = engine.schedules
    assert max(len(p.scheduled) for p in plans) == 2
    ids = [frozenset(s.request.request_id for s in p.scheduled) for p in plans]
    assert ids[0] != ids[1] and ids[0] == ids[2] and ids[1] == ids[3]  # two groups alternate
    assert engine.in_flight.depths[2] >= len(plans) - 2


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_preemption_with_steps_in_flight_keeps_outputs_right_and_frees_every_page(policy):
    """12 pages of 4 tokens for 6 growing requests: preemptions happen while the other batch is in
    flight; its requests are never the victims (their pages are being written)."""
    engine = pipelined_engine(policy, num_pages=12, max_num_seqs=6, max_num_batched_tokens=32)
    requests = [([(5 * i + j) % VOCAB for j in range(6)], 14) for i in range(6)]
    outputs, _ = run(engine, requests)
    for (prompt, max_tokens), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.scheduler.num_preemptions > 0
    assert max(engine.in_flight.depths) == 2
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_victims_are_never_in_flight():
    engine = pipelined_engine("paged", num_pages=12, max_num_seqs=6, max_num_batched_tokens=32)
    scheduler = engine.scheduler
    real_preempt = scheduler._preempt
    victims_in_flight = []

    def preempt(victim, out):
        victims_in_flight.append(scheduler.in_flight.holds(victim))
        real_preempt(victim, out)

    scheduler._preempt = preempt
    run(engine, [([(5 * i + j) % VOCAB for j in range(6)], 14) for i in range(6)])
    assert victims_in_flight and not any(victims_in_flight)


@pytest.mark.parametrize("policy", ["orca", "chunked"])
def test_abort_of_a_request_in_flight_frees_its_pages_and_spares_the_others(policy):
    engine = pipelined_engine(policy, max_num_seqs=4)
    requests = {engine.add_request(p, SamplingParams(max_tokens=8, temperature=0)): (p, 8)
                for p in ([10 * i + 1, 10 * i + 2] for i in range(4))}
    while not engine.in_flight:  # between steps, a full pipeline of depth 2 holds one step in flight
        engine.step()
    abort_spares_the_others(engine, next(s.request for s in engine.in_flight[0][0].scheduled), requests)


def test_one_deep_pipeline_dispatches_and_collects_in_the_same_step():
    engine = pipelined_engine("chunked", depth=1)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    outputs = engine.step()
    assert not engine.in_flight and outputs[0].outputs[0].token_ids == [4]
    assert dataclasses.asdict(engine.scheduler.config)["max_num_seqs"] == engine.scheduler.max_seqs_per_step
