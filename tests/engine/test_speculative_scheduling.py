"""Speculative decoding's host side with the mock runner (tests/engine/mock_runner.py): drafts in
the plan, acceptance, KV pages of rejected drafts, stops among accepted drafts, the draft policy."""

import pytest

from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from orca_jax.engine.engine import LLMEngine
from orca_jax.engine.speculation import PROBE_INTERVAL
from orca_jax.sampling_params import SamplingParams

from .mock_runner import MockRunner, record_schedules
from .test_scheduler import MODEL, POLICIES, VOCAB, expected_output, mixed_workload, run

K = 3


def right_drafts(token):
    return [(token + 1 + i) % VOCAB for i in range(K)]


def half_right_drafts(token):
    """The first draft right, then a wrong one: one accepted per step, and a rejection."""
    return [(token + 1) % VOCAB, (token + 7) % VOCAB, (token + 3) % VOCAB]


def wrong_drafts(token):
    return [(token + 5 + i) % VOCAB for i in range(K)]


def spec_engine(policy, propose=right_drafts, *, depth=1, num_pages=64, page_size=4, max_num_seqs=4,
                max_num_batched_tokens=64, prefix_caching=False, disable_by_batch_size=8, feeds=False):
    """`feeds`: a runner that feeds sampled tokens, so the engine schedules asynchronously."""
    config = EngineConfig(
        model="mock",
        cache=CacheConfig(page_size=page_size, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(policy=policy, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        speculative_config=SpeculativeConfig(num_speculative_tokens=K, disable_by_batch_size=disable_by_batch_size),
    )
    runner = MockRunner(num_pages, page_size, VOCAB, max_in_flight=depth, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=K, propose=propose,
                        feeds_sampled_tokens=feeds)
    engine = LLMEngine(config, MODEL, runner, tokenizer=None)
    engine.schedules = record_schedules(engine)
    return engine


def long_workload(n=6):
    return [([(11 * i + j) % VOCAB for j in range(2 + i)], 12 + 3 * i) for i in range(n)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("propose", [right_drafts, half_right_drafts, wrong_drafts])
@pytest.mark.parametrize("policy", POLICIES)
def test_outputs_are_those_without_drafts_and_every_page_comes_back(policy, propose, depth):
    engine = spec_engine(policy, propose, depth=depth)
    workload = mixed_workload() + long_workload()
    outputs, _ = run(engine, workload)
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
        assert out.outputs[0].finish_reason == "length"
    assert engine.kv.num_free_pages == engine.kv.num_pages
    stats = engine.drafts.stats
    assert stats.num_draft_tokens > 0
    accepted = sum(o.metrics.num_accepted_tokens for o in outputs)
    assert accepted == stats.num_accepted_tokens
    if propose is wrong_drafts:
        assert accepted == 0
    else:
        assert accepted > 0
    assert engine.num_generated_tokens == sum(m for _, m in workload)


def test_right_drafts_take_fewer_steps_than_no_drafts():
    workload = long_workload()
    with_drafts = spec_engine("chunked", right_drafts)
    run(with_drafts, workload)
    without = spec_engine("chunked", lambda token: [])
    run(without, workload)
    assert with_drafts.num_steps < 0.6 * without.num_steps
    assert without.drafts.stats.num_draft_tokens == 0


def no_drafts(token):
    return []


def drafts_in_runs(token):
    """Right drafts after runs of tokens, none after the others: matches come and go, and last a
    few tokens (as a copied span's do)."""
    return right_drafts(token) if token % 16 < 8 else []


@pytest.mark.parametrize("propose", [no_drafts, right_drafts, drafts_in_runs])
@pytest.mark.parametrize("policy", ["orca", "paged", "chunked"])
def test_async_scheduling_plans_ahead_the_steps_without_drafts(policy, propose):
    """With async scheduling, a step that verifies drafts waits for the result before it (its
    drafts come from there), and a request whose step in flight is unlikely to propose any is
    planned ahead: without matches every decode overlaps, with right drafts none are lost."""
    workload = [(prompt, 64) for prompt, _ in long_workload()]  # long enough for runs to come and go
    engine = spec_engine(policy, propose, feeds=True, num_pages=128)
    outputs, _ = run(engine, workload)
    for (prompt, max_tokens), out in zip(workload, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.kv.num_free_pages == engine.kv.num_pages
    assert engine.in_flight.plans_ahead
    sync = spec_engine(policy, propose, num_pages=128)
    run(sync, workload)
    overlapped = engine.in_flight.depths[2]
    drafted, sync_drafted = engine.drafts.stats.num_draft_tokens, sync.drafts.stats.num_draft_tokens
    if propose is no_drafts:
        assert drafted == 0 and overlapped > 0
    elif propose is right_drafts:  # as many drafts verified, as few steps, as without async scheduling
        assert drafted > 0 and engine.num_steps <= sync.num_steps
    else:  # a run of matches starts a step late (the step planned ahead), then its drafts are verified
        assert overlapped > 0 and drafted >= 0.8 * sync_drafted > 0


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_preemption_with_drafts_in_flight_keeps_outputs_and_frees_every_page(policy):
    engine = spec_engine(policy, half_right_drafts, depth=2, num_pages=12, max_num_seqs=6, max_num_batched_tokens=32)
    requests = [([(5 * i + j) % VOCAB for j in range(6)], 14) for i in range(6)]
    outputs, _ = run(engine, requests)
    for (prompt, max_tokens), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == expected_output(prompt, max_tokens)
    assert engine.scheduler.num_preemptions > 0
    assert engine.drafts.stats.num_draft_tokens > 0
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_abort_with_drafts_in_flight_frees_every_page():
    engine = spec_engine("paged", half_right_drafts, depth=2)
    ids = [engine.add_request(list(p), SamplingParams(max_tokens=m, temperature=0)) for p, m in long_workload(4)]
    aborted_in_flight = 0
    for step in range(200):
        engine.step()
        held = {s.request.request_id for out, _ in engine.in_flight for s in out.scheduled if s.draft_token_ids}
        for request_id in ids[:2]:
            if request_id in held and engine.abort(request_id):
                aborted_in_flight += 1
        if not engine.has_unfinished_requests():
            break
    assert aborted_in_flight == 2
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_rejected_drafts_never_enter_the_prefix_cache():
    """A page's worth of wrong drafts per step: if their slots counted as computed, pages of
    them would be hashed and served to the next request with the same prompt."""
    engine = spec_engine("paged", wrong_drafts, page_size=2, prefix_caching=True, max_num_seqs=1)
    prompt = [3, 4, 5]
    outputs, _ = run(engine, [(prompt, 9), (prompt + expected_output(prompt, 9), 3)])
    assert outputs[0].outputs[0].token_ids == expected_output(prompt, 9)
    assert engine.drafts.stats.num_draft_tokens > 0
    real = outputs[1].prompt_token_ids + outputs[1].outputs[0].token_ids  # extends the first request's tokens
    kv = engine.kv
    probe = type("Probe", (), {"request_id": "probe", "token_ids_between": lambda self, a, b: real[a:b]})()
    real_hashes = kv._page_hashes(probe, len(real) // kv.page_size)  # the chained hashes of the real pages
    assert kv.hash_to_page and set(kv.hash_to_page) <= set(real_hashes)
    assert outputs[1].metrics.num_cached_prompt_tokens > 0  # the real pages were cached and shared


def test_pages_filled_by_accepted_drafts_are_cached_under_their_own_tokens():
    """Accepted drafts are computed in the step that verifies them, but join the request's tokens
    only when the engine appends the step's output: a page they fill must be hashed from its real
    tokens (one step later), not from the tokens known at the end of the step, or it is never
    shared."""
    engine = spec_engine("paged", right_drafts, page_size=2, prefix_caching=True, max_num_seqs=1)
    prompt = [3, 4, 5]
    first = expected_output(prompt, 13)
    outputs, _ = run(engine, [(prompt, 13), (prompt + first, 2)])
    assert engine.drafts.stats.num_accepted_tokens > 0
    real = outputs[1].prompt_token_ids + outputs[1].outputs[0].token_ids  # extends the first request's tokens
    kv = engine.kv
    probe = type("Probe", (), {"request_id": "probe", "token_ids_between": lambda self, a, b: real[a:b]})()
    real_hashes = kv._page_hashes(probe, len(real) // kv.page_size)
    assert set(kv.hash_to_page) <= set(real_hashes)
    # The first request computed all of its tokens but its last output: every full page of them is shared.
    computed = len(prompt) + len(first) - 1
    assert outputs[1].metrics.num_cached_prompt_tokens == computed // kv.page_size * kv.page_size


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_after_every_step_a_requests_pages_hold_every_token_it_has_computed(policy):
    """The pages given back after a step are those that held only rejected drafts, never one that
    holds an accepted draft's K/V (one draft accepted per step, two-token pages: the accepted ones
    often start a page)."""
    engine = spec_engine(policy, half_right_drafts, page_size=2)
    for prompt, max_tokens in long_workload():
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    accepted = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert len(request.block_table) >= engine.kv.pages_for(request.num_computed_tokens), request.request_id
        accepted = engine.drafts.stats.num_accepted_tokens
    assert accepted > 0


def test_a_stop_token_among_accepted_drafts_ends_the_output_there():
    engine = spec_engine("chunked", right_drafts)
    prompt = [10, 11]
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[19]))]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    out = done[ids[0]].outputs[0]
    assert out.token_ids == list(range(12, 20)) and out.finish_reason == "stop"
    assert engine.drafts.stats.num_accepted_tokens > 0


def test_no_drafts_at_or_above_disable_by_batch_size():
    engine = spec_engine("chunked", right_drafts, disable_by_batch_size=3, max_num_seqs=4)
    run(engine, [([i + 1, i + 2], 4 + 6 * i) for i in range(4)])
    for plan in engine.schedules:
        if plan.num_draft_tokens:
            assert len(plan.scheduled) < 3
    assert engine.drafts.stats.num_draft_tokens > 0  # once the short requests finished, the rest drafted


def test_a_step_verifies_at_most_the_rows_its_decodes_leave_below_disable_by_batch_size():
    """Drafts of all requests together fill at most disable_by_batch_size - decodes rows: 2 decodes
    with 3 drafts each at a limit of 6 verify 4 in all, not 6 (the step stays memory-bound)."""
    engine = spec_engine("chunked", right_drafts, disable_by_batch_size=6, max_num_seqs=4)
    run(engine, [([i + 1, i + 2], 12) for i in range(2)])
    decoding = [plan for plan in engine.schedules if all(p.num_new_tokens == 1 + len(p.draft_token_ids)
                                                         for p in plan.scheduled) and len(plan.scheduled) == 2]
    assert decoding, "no step decoded both requests"
    for plan in decoding:
        assert plan.num_draft_tokens <= 6 - 2
    assert max(plan.num_draft_tokens for plan in decoding) == 4  # the first in order got K = 3, the next 1


def test_failing_drafts_drop_to_none_then_probe():
    engine = spec_engine("chunked", wrong_drafts, max_num_seqs=1)
    run(engine, [([1, 2], 60)])
    drafted = [p.num_draft_tokens for p in engine.schedules][1:]  # after the prefill
    # The estimate starts at 3/4 and decays by DECAY a failed step: 0.75, 0.46, 0.31, 0.22, 0.16, 0.12,
    # 0.09, 0.07, then below DRAFT_ROW_COST. Each draft is verified while its chance (rate^j) is worth
    # a row: rate^j >= DRAFT_ROW_COST * (1 + rate + ... + rate^(j-1)).
    assert drafted[:9] == [3, 2, 2, 1, 1, 1, 1, 1, 0]
    assert sum(drafted[8:]) <= 60 // PROBE_INTERVAL  # then only probes, one draft each
    assert drafted[8:].count(1) >= 2


def test_a_request_whose_text_turns_repetitive_drafts_again_within_a_few_steps():
    """Drafts fail while the tokens are below 32, then every one passes (a copied span begins): the
    estimate counts recent steps most, so after the probe that passes the request is back to all K
    drafts within a few steps, not after as many right drafts as it saw wrong ones."""
    engine = spec_engine("chunked", lambda token: wrong_drafts(token) if token < 32 else right_drafts(token),
                         max_num_seqs=1)
    run(engine, [([1, 2], 90)])
    drafted = [p.num_draft_tokens for p in engine.schedules][1:]
    first_zero = drafted.index(0)
    probes = [i for i in range(first_zero, len(drafted)) if drafted[i] == 1 and drafted[i - 1] == 0]
    assert probes[0] - first_zero == PROBE_INTERVAL, drafted
    passed = probes[-1]  # the probe of the first copied token; those before it failed
    assert K in drafted[passed + 1:passed + 4], drafted
