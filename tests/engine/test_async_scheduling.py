"""Async scheduling through the engine, with a mock runner that feeds sampled tokens as the one-stage
model runner does (tests/engine/mock_runner.py): a step is planned and dispatched while the one
before it is in flight, continuing its requests on tokens that are not back yet."""

import pytest

from orca_jax.sampling_params import SamplingParams

from .test_scheduler import (POLICIES, VOCAB, abort_spares_the_others, expected_output, finish, make_engine,
                             mixed_workload, run)


def fed_steps(engine) -> int:
    """Steps that continued a request on a token still in flight."""
    return sum(any(s.fed_from_row >= 0 for s in out.scheduled) for out in engine.schedules)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_right_outputs_with_steps_planned_ahead(policy):
    engine = make_engine(policy, async_scheduling=True)
    outputs, _ = run(engine, mixed_workload())
    for (prompt, max_tokens), out in zip(mixed_workload(), outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.kv.num_free_pages == engine.kv.num_pages
    if policy == "static":  # its batch steps as one: nothing is planned while its step is in flight
        assert fed_steps(engine) == 0 and max(engine.in_flight.depths) == 1
    else:
        assert fed_steps(engine) > len(engine.schedules) // 2
        assert max(engine.in_flight.depths) == 2


def test_a_lone_decode_always_has_its_next_step_in_flight():
    """One request of 12 tokens: its prefill, then 11 decodes, every one planned ahead on the token
    of the step before (the last is not: that step ends the request by length)."""
    engine = make_engine("chunked", async_scheduling=True)
    outputs, _ = run(engine, [([5, 6, 7], 12)])
    assert outputs[0].outputs[0].token_ids == expected_output([5, 6, 7], 12)
    assert len(engine.schedules) == 12  # no step wasted past max_tokens
    assert fed_steps(engine) == 11
    assert engine.runner.num_fed_tokens == 11


def test_a_stop_token_drops_the_token_computed_ahead_and_frees_every_page():
    """The step in flight behind a stop computes one token too many: it is not in the output, and
    the outputs are those of steps taken one at a time."""
    prompt = [10, 11, 12]
    stop = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[16])  # the 4th output token
    results = {}
    for async_scheduling in (False, True):
        engine = make_engine("paged", async_scheduling=async_scheduling)
        request_id = engine.add_request(list(prompt), stop)
        other = engine.add_request([1, 2], SamplingParams(max_tokens=9, temperature=0))
        done = finish(engine)
        results[async_scheduling] = done[request_id].outputs[0], done[other].outputs[0]
        assert engine.kv.num_free_pages == engine.kv.num_pages
    (sync, sync_other), (ahead, ahead_other) = results[False], results[True]
    assert ahead.token_ids == sync.token_ids == [13, 14, 15, 16]
    assert ahead.finish_reason == sync.finish_reason == "stop"
    assert ahead_other.token_ids == sync_other.token_ids == expected_output([1, 2], 9)


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_preemption_with_a_step_planned_ahead_keeps_outputs_right_and_frees_every_page(policy):
    """12 pages of 4 tokens for 6 growing requests: requests in flight are never preempted (their
    next step is simply not planned ahead when pages run short)."""
    engine = make_engine(policy, num_pages=12, max_num_seqs=6, max_num_batched_tokens=32, async_scheduling=True)
    requests = [([(5 * i + j) % VOCAB for j in range(6)], 14) for i in range(6)]
    outputs, _ = run(engine, requests)
    for (prompt, max_tokens), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.scheduler.num_preemptions > 0
    assert fed_steps(engine) > 0
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_abort_with_two_steps_in_flight_frees_its_pages_and_spares_the_others():
    engine = make_engine("chunked", async_scheduling=True)
    requests = {engine.add_request(p, SamplingParams(max_tokens=8, temperature=0)): (p, 8)
                for p in ([10 * i + 1, 10 * i + 2] for i in range(3))}
    while len(engine.in_flight) < 1 or engine.schedules[-1].scheduled[0].fed_from_row < 0:
        engine.step()  # until a step planned ahead is among those in flight
    abort_spares_the_others(engine, engine.schedules[-1].scheduled[0].request, requests)


def test_a_request_whose_next_step_needs_its_token_on_the_host_holds_the_next_plan_back():
    """Penalties count the tokens so far on the host: while such a request is in flight nothing
    is planned ahead (the others wait with it, rather than it running every other step)."""
    engine = make_engine("chunked", async_scheduling=True)
    penalized = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.1)
    plain = SamplingParams(max_tokens=10, temperature=0)
    ids = [engine.add_request([3, 4], penalized), engine.add_request([7, 8], plain)]
    done = finish(engine)
    assert done[ids[0]].outputs[0].token_ids == expected_output([3, 4], 6)
    assert done[ids[1]].outputs[0].token_ids == expected_output([7, 8], 10)
    fed = [out for out in engine.schedules if any(s.fed_from_row >= 0 for s in out.scheduled)]
    assert fed, "once the penalized request is done, the other is planned ahead"
    assert all(len(out.scheduled) == 1 and out.scheduled[0].request.request_id == ids[1] for out in fed)
    both = [out for out in engine.schedules if len(out.scheduled) == 2]
    assert len(both) == 6  # the two requests stepped together for every token of the penalized one


def test_without_async_scheduling_every_step_is_collected_before_the_next():
    engine = make_engine("chunked", async_scheduling=False)
    run(engine, mixed_workload())
    assert fed_steps(engine) == 0 and max(engine.in_flight.depths) == 1
