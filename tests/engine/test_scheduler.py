"""Scheduling policies, driven through the engine by a mock runner (no model, milliseconds)."""

import dataclasses

import pytest

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.engine.engine import LLMEngine, RequestRejected
from orca_jax.sampling_params import SamplingParams

from .mock_runner import MockRunner, record_schedules

VOCAB = 1000
POLICIES = ["static", "orca", "paged", "chunked"]
MODEL = dataclasses.replace(load_model_preset("tiny"), vocab_size=VOCAB, eos_token_id=None, max_position=4096)


def make_engine(policy, *, num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, prefix_caching=False,
                depth=1, async_scheduling=False):
    """An engine over the mock runner; `depth` > 1 lets it keep that many steps in flight (a pipeline);
    `async_scheduling` gives it a runner that feeds sampled tokens, so it plans steps ahead."""
    config = EngineConfig(
        model="mock",
        cache=CacheConfig(page_size=page_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling),
    )
    runner = MockRunner(num_pages, page_size, VOCAB, max_in_flight=depth, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, feeds_sampled_tokens=async_scheduling)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    engine.schedules = record_schedules(engine)  # what the tests below inspect
    return engine


def expected_output(prompt, max_tokens):
    return [(prompt[-1] + i) % VOCAB for i in range(1, max_tokens + 1)]


def run(engine, requests):
    """requests: [(prompt, max_tokens)]; returns {request_id: output token ids} and the step log."""
    ids = [engine.add_request(list(p), SamplingParams(max_tokens=m, temperature=0)) for p, m in requests]
    done, steps = {}, []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps.append(outputs)
        for out in outputs:
            if out.finished:
                done[out.request_id] = out
        assert len(steps) < 10_000
    return [done[i] for i in ids], steps


def finish(engine, never: str | None = None) -> dict:
    """Steps the engine until nothing is left; returns the finished outputs by request id. The
    request `never` (an aborted one) must get no output meanwhile."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != never, "an aborted request got output"
            if out.finished:
                done[out.request_id] = out
    return done


def abort_spares_the_others(engine, victim, requests: dict) -> None:
    """Aborts `victim` (a request in a step in flight) and runs the engine dry: it gets no output,
    the others (`requests`: request id -> (prompt, max_tokens)) their right ones, every page comes back."""
    assert engine.in_flight.holds(victim)
    assert engine.abort(victim.request_id)
    done = finish(engine, never=victim.request_id)
    for request_id, (prompt, max_tokens) in requests.items():
        if request_id != victim.request_id:
            assert done[request_id].outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.kv.num_free_pages == engine.kv.num_pages


def mixed_workload(n=10):
    return [([(7 * i + j) % VOCAB for j in range(3 + (5 * i) % 13)], 1 + (3 * i) % 9) for i in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_every_request_its_right_output(policy, depth):
    """Also with two steps in flight (a pipeline): the mock refuses a request in two of them."""
    engine = make_engine(policy, depth=depth)
    outputs, _ = run(engine, mixed_workload())
    for (prompt, max_tokens), out in zip(mixed_workload(), outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
        assert out.outputs[0].finish_reason == "length"
    assert engine.kv.num_free_pages == engine.kv.num_pages  # everything returned
    assert not engine.in_flight and not engine.runner.pending
    if policy == "static":  # a static batch steps as one: nothing to overlap it with
        assert set(engine.in_flight.depths) == {1}
    else:
        assert max(engine.in_flight.depths) == depth


def test_static_admits_only_into_an_empty_batch_and_releases_together():
    engine = make_engine("static", max_num_seqs=3)
    workload = [([1, 2, 3], 2), ([4, 5], 6), ([6], 3), ([7, 8], 1)]
    outputs, steps = run(engine, workload)
    plans = engine.schedules
    # First batch: the first three requests; the fourth waits until all three are done.
    first_batch = {p.request.request_id for p in plans[0].scheduled}
    assert first_batch == {"0", "1", "2"}
    batch_steps = [p for p in plans if any(s.request.request_id in first_batch for s in p.scheduled)]
    assert len(batch_steps) == 6  # the longest member (max_tokens 6) sets the batch length
    assert all(s.request.request_id != "3" for p in batch_steps for s in p.scheduled)
    # Finished members stay as padding rows: the batch keeps its shape of 3.
    assert [p.num_seqs for p in batch_steps] == [3] * 6
    assert [p.num_padding_seqs for p in batch_steps] == [0, 0, 1, 2, 2, 2]
    # Results of the first batch all come out in the same step, when the last member finishes.
    release_steps = {out.request_id: i for i, outs in enumerate(steps) for out in outs if out.finished}
    assert release_steps["0"] == release_steps["1"] == release_steps["2"] < release_steps["3"]
    assert all(o.outputs[0].token_ids == expected_output(p, m) for (p, m), o in zip(workload, outputs))


def test_static_prefills_a_large_batch_over_several_steps_before_decoding():
    engine = make_engine("static", max_num_seqs=4, max_num_batched_tokens=16)
    workload = [([i + 1] * 10, 3) for i in range(4)]  # 40 prompt tokens, 16 per step
    outputs, _ = run(engine, workload)
    plans = engine.schedules
    # One whole prompt per step fits the budget; nobody decodes until the whole batch is prefilled.
    assert [[p.num_new_tokens for p in plan.scheduled] for plan in plans[:4]] == [[10], [10], [10], [10]]
    decode_steps = plans[4:]
    assert [len(plan.scheduled) for plan in decode_steps] == [4, 4]  # then the batch decodes as one
    assert all(o.outputs[0].token_ids == expected_output(p, m) for (p, m), o in zip(workload, outputs))


def test_orca_never_preempts_nor_overcommits_its_reservation():
    engine = make_engine("orca", num_pages=12, page_size=4, max_num_seqs=8)
    workload = [([i] * 5, 10) for i in range(1, 9)]  # each reserves ceil(15 / 4) = 4 pages of 12
    for prompt, max_tokens in workload:
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    max_running = 0
    while engine.has_unfinished_requests():
        engine.step()
        reserved = sum(len(r.block_table) for r in engine.scheduler.running)
        assert reserved <= engine.kv.num_pages
        max_running = max(max_running, engine.scheduler.num_running)
    assert engine.scheduler.num_preemptions == 0
    assert max_running == 3  # 3 reservations of 4 pages fit in 12
    assert engine.kv.num_free_pages == engine.kv.num_pages  # every reservation came back


def test_orca_admits_every_iteration_fcfs():
    engine = make_engine("orca", max_num_seqs=2)
    run(engine, [([1], 1), ([2], 5), ([3], 1)])
    plans = engine.schedules
    # Request 0 finishes after step 1, so request 2 joins at step 2 while request 1 is still decoding.
    assert [p.request.request_id for p in plans[0].scheduled] == ["0", "1"]
    assert [p.request.request_id for p in plans[1].scheduled] == ["1", "2"]


def test_chunked_puts_decodes_first_and_respects_the_token_budget():
    engine = make_engine("chunked", max_num_seqs=4, max_num_batched_tokens=16)
    workload = [([1] * 3, 8), ([2] * 40, 3), ([3] * 25, 4), ([4] * 2, 6)]
    outputs, _ = run(engine, workload)
    for plan in engine.schedules:
        assert plan.num_batched_tokens <= 16
        kinds = [p.num_new_tokens == 1 and p.start > 0 for p in plan.scheduled]
        # Decodes come before any prefill chunk within the step.
        assert kinds == sorted(kinds, reverse=True)
    chunks = [p.num_new_tokens for plan in engine.schedules for p in plan.scheduled if p.request.request_id == "1"]
    assert chunks[0] < 40 and sum(c for c in chunks if c > 1) >= 40  # the long prompt was split
    assert all(o.outputs[0].token_ids == expected_output(p, m) for (p, m), o in zip(workload, outputs))


def test_paged_recomputes_a_long_preempted_request_in_budget_sized_pieces():
    engine = make_engine("paged", num_pages=12, page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    workload = [([1] * 10, 30), ([2] * 10, 30)]  # 40 tokens each: a recompute exceeds the budget of 16
    outputs, _ = run(engine, workload)
    assert engine.scheduler.num_preemptions > 0
    assert all(plan.num_batched_tokens <= 16 for plan in engine.schedules)
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_preemption_under_a_small_cache_keeps_outputs_right(policy):
    engine = make_engine(policy, num_pages=10, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    workload = [([i + 1] * 6, 14) for i in range(4)]  # 4 x 20 tokens = 20 pages wanted, 10 exist
    outputs, _ = run(engine, workload)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) == engine.scheduler.num_preemptions
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_preemption_victim_has_fewest_computed_tokens_and_returns_to_the_head():
    engine = make_engine("paged", num_pages=6, page_size=4, max_num_seqs=3)
    engine.add_request([1] * 8, SamplingParams(max_tokens=12))  # long-running
    engine.add_request([2] * 3, SamplingParams(max_tokens=12))  # fewer computed tokens: the victim
    engine.add_request([3] * 3, SamplingParams(max_tokens=2))  # waits behind them
    while engine.scheduler.num_preemptions == 0:
        engine.step()
    victim = [r for r in engine.scheduler.waiting if r.metrics.num_preemptions][0]
    assert victim.request_id == "1"
    assert engine.scheduler.waiting[0] is victim  # back at the head, before request 2
    assert victim.num_computed_tokens == 0 and victim.block_table == []



def test_a_preempted_request_is_scheduled_before_those_already_waiting():
    engine = make_engine("paged", num_pages=6, page_size=4, max_num_seqs=2)
    workload = [([1] * 8, 12), ([2] * 3, 12), ([3] * 3, 2), ([4] * 3, 2)]  # 2 and 3 wait: max_num_seqs
    outputs, _ = run(engine, workload)
    plans = engine.schedules
    at = next(i for i, plan in enumerate(plans) if plan.preempted)
    assert [r.request_id for r in plans[at].preempted] == ["1"]
    before = {s.request.request_id for plan in plans[:at] for s in plan.scheduled}
    assert before == {"0", "1"}  # 2 and 3 were already waiting when 1 was preempted
    after = [s.request.request_id for plan in plans[at + 1:] for s in plan.scheduled if s.request.request_id != "0"]
    assert list(dict.fromkeys(after)) == ["1", "2", "3"]  # the victim first, though 2 and 3 would fit sooner
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)

@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_prefix_caching_hits_on_a_shared_prefix(policy):
    engine = make_engine(policy, prefix_caching=True, max_num_seqs=1)
    shared = list(range(100, 124))  # 6 full pages of 4
    workload = [(shared + [i], 3) for i in range(4)]
    outputs, _ = run(engine, workload)
    cached = [o.metrics.num_cached_prompt_tokens for o in outputs]
    assert cached == [0, 24, 24, 24]
    computed = [p.num_new_tokens for plan in engine.schedules for p in plan.scheduled if p.start == 0 or p.start == 24]
    assert computed[0] == 25 and computed.count(1) >= 3  # later prompts computed only their last token
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)


def test_abort_frees_pages_at_once():
    for policy in POLICIES:
        engine = make_engine(policy)
        keep = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20))
        drop = engine.add_request([4, 5, 6, 7, 8], SamplingParams(max_tokens=20))
        waiting = engine.add_request([9], SamplingParams(max_tokens=20))
        engine.step()
        used_before = engine.kv.num_used_pages
        dropped = engine.scheduler.running[1] if policy != "static" else None
        assert engine.abort(drop)
        assert not engine.abort("nope")
        if policy != "static":  # static keeps a batch's memory until the batch completes
            assert engine.kv.num_used_pages < used_before
            assert dropped.block_table == []
        engine.abort(waiting)
        engine.abort(keep)
        assert engine.kv.num_free_pages == engine.kv.num_pages, policy
        assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("policy, prompt_len, max_tokens, limit", [
    ("orca", 70, 1, "max_num_batched_tokens=64"),
    ("paged", 65, 3, "max_num_batched_tokens=64"),
    ("chunked", 4000, 200, "context length of 4096"),
    ("chunked", 200, 100, "whole KV cache"),
])
def test_requests_that_can_never_fit_are_rejected_naming_the_limit(policy, prompt_len, max_tokens, limit):
    engine = make_engine(policy)  # 64 pages x 4 tokens = 256 tokens of cache
    with pytest.raises(RequestRejected, match=limit):
        engine.add_request([1] * prompt_len, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished_requests()


def test_bad_prompts_are_rejected():
    engine = make_engine("chunked")
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.add_request([5, VOCAB], SamplingParams())
