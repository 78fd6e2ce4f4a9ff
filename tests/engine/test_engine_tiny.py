"""The engine on the trained tiny model: right answers in a crowd, sampling features, zero
recompiles (batch invariance: test_batched_equals_solo.py)."""

import dataclasses
import random

import numpy as np
import pytest

from orca_jax.checkpoint.train_tiny import EOS, counting_sequence
from orca_jax.sampling_params import SamplingParams

from .conftest import TINY_LIMITS, make_engine, run_all

POLICIES = ["static", "orca", "paged", "chunked"]


def workload():
    """More requests than max_num_seqs (8); prompt lengths around the page size (4): 3, 4, 5, 8, 9...;
    outputs from 1 token to the end of the count."""
    rng = random.Random(0)
    requests = []
    for i, prompt_len in enumerate([3, 4, 5, 8, 9, 12, 3, 4, 16, 7, 5, 3]):
        step = 1 + i % 4
        start = rng.randrange(0, 63 - step * prompt_len) if 63 - step * prompt_len > 0 else 0
        sentence = counting_sequence(start, step)
        prompt = sentence[:prompt_len]
        requests.append((prompt, rng.choice([1, 5, 13, 40])))
    return requests


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def seeded(max_tokens, seed):
    return SamplingParams(temperature=3.0, top_p=0.95, max_tokens=max_tokens, seed=seed)


def test_right_continuations_in_a_crowded_batch(tiny_runner, tiny_trained):
    requests = [(p, greedy(100)) for p, _ in workload()]
    for policy in POLICIES:
        outputs = run_all(make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS), requests)
        for (prompt, _), out in zip(requests, outputs):
            step = prompt[2] - prompt[1]
            expected = counting_sequence(prompt[1], step)[len(prompt):]
            assert out.outputs[0].token_ids == expected, policy
            assert out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_preemption_with_the_real_model_keeps_outputs_right(tiny_runner, tiny_trained, policy):
    requests = [(counting_sequence(i, 1)[:4], greedy(30)) for i in range(8)]
    engine = make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS)
    engine.kv.__init__(num_pages=20, page_size=4)  # 80 token slots for 8 x 34 tokens wanted
    outputs = run_all(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for (prompt, _), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == counting_sequence(prompt[1], 1)[4:4 + 30]


@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_prefix_caching_hits_and_outputs_stay_right(tiny_runner, tiny_trained, policy):
    shared = counting_sequence(0, 2)[:13]  # 3 full pages + 1 token
    requests = [(shared, greedy(10)) for _ in range(3)] + [(shared[:9], greedy(10))]
    engine = make_engine(tiny_runner, tiny_trained, policy, prefix_caching=True, max_num_seqs=1,
                         max_num_batched_tokens=64)
    outputs = run_all(engine, requests)
    assert [o.metrics.num_cached_prompt_tokens for o in outputs] == [0, 12, 12, 8]
    for (prompt, _), out in zip(requests, outputs):
        assert out.outputs[0].token_ids == counting_sequence(0, 2)[len(prompt):len(prompt) + 10]



@pytest.mark.parametrize("policy", ["paged", "chunked"])
def test_prefix_caching_does_not_reuse_a_page_from_another_position(tiny_runner, tiny_trained, policy):
    """A prompt whose first page equals the second page of a cached prompt shares nothing: that
    page's K/V were computed at positions 4..7 after other tokens. Reusing them miscounts (step 3
    turns into step 1), so the output must equal the run without prefix caching."""
    count = counting_sequence(20, 3)  # <s> 20 23 26 29 32 ...
    cached = counting_sequence(61, 1)[:4] + count[:4] + [40]  # pages [<s> 61 62 63], [<s> 20 23 26]
    later = count[:5]  # first page [<s> 20 23 26], as the cached prompt's second page
    same_prefix = cached[:8] + [41]  # after the same first page the second page is shared
    requests = [(cached, greedy(8)), (later, greedy(8)), (same_prefix, greedy(8))]
    engine = make_engine(tiny_runner, tiny_trained, policy, prefix_caching=True, max_num_seqs=1,
                         max_num_batched_tokens=64)
    outputs = run_all(engine, requests)
    uncached = run_all(make_engine(tiny_runner, tiny_trained, policy, max_num_seqs=1, max_num_batched_tokens=64),
                       requests)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in uncached]
    assert outputs[1].outputs[0].token_ids == count[5:13]
    assert [o.metrics.num_cached_prompt_tokens for o in outputs] == [0, 0, 8]

def test_stop_strings_tokens_min_tokens_and_ignore_eos(tiny_runner, tiny_trained):
    tok = tiny_trained.tokenizer
    engine = make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS)
    prompt = tok.encode("3 5")
    out = run_all(engine, [
        (prompt, SamplingParams(temperature=0, max_tokens=50, stop=["13"])),
        (prompt, SamplingParams(temperature=0, max_tokens=50, stop=["13"], include_stop_str_in_output=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[11])),
        (tok.encode("58 60"), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        (tok.encode("58 60"), SamplingParams(temperature=0, max_tokens=6, min_tokens=4)),
        (tok.encode("58 60"), SamplingParams(temperature=0, max_tokens=6)),
    ])
    assert out[0].outputs[0].text == " 7 9 11 " and out[0].outputs[0].finish_reason == "stop"
    assert out[0].outputs[0].stop_reason == "13"
    assert out[1].outputs[0].text == " 7 9 11 13"
    assert out[2].outputs[0].token_ids == [7, 9, 11] and out[2].outputs[0].stop_reason == 11
    ignored = out[3].outputs[0]
    assert ignored.token_ids[:2] == [62, EOS] and len(ignored.token_ids) == 6 and ignored.finish_reason == "length"
    assert EOS not in out[4].outputs[0].token_ids[:4] and len(out[4].outputs[0].token_ids) >= 4
    assert out[5].outputs[0].token_ids == [62, EOS] and out[5].outputs[0].text == " 62"


def test_logprobs_n_and_seeds(tiny_runner, tiny_trained):
    engine = make_engine(tiny_runner, tiny_trained, "orca", **TINY_LIMITS)
    prompt = counting_sequence(10, 3)[:4]
    params = SamplingParams(temperature=5.0, max_tokens=6, n=3, seed=7, logprobs=3)
    first, again, greedy_out = run_all(engine, [(prompt, params), (prompt, params), (prompt, greedy(3))])
    assert len(first.outputs) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]  # same seed, same draws
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the n samples differ
    for completion in first.outputs:
        assert len(completion.logprobs) == len(completion.token_ids)
        for token, entry in zip(completion.token_ids, completion.logprobs):
            assert token in entry
            ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
            assert [lp.rank for lp in ranked] == [1, 2, 3]
            assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
            assert all(lp.logprob <= 0 for lp in entry.values())
        assert completion.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs)), abs=1e-4)
    # Greedy picks the rank-1 token, whose logprob is near 0 for this confident model.
    assert greedy_out.outputs[0].token_ids == counting_sequence(10, 3)[4:7]
    # A request that did not ask gets no logprobs, even in steps that computed them for the others (vLLM's way).
    assert greedy_out.outputs[0].logprobs is None and greedy_out.outputs[0].cumulative_logprob is None
    asked = run_all(engine, [(prompt, dataclasses.replace(greedy(3), logprobs=0))])[0].outputs[0]
    assert asked.token_ids == greedy_out.outputs[0].token_ids and -1.0 < asked.cumulative_logprob < 0


def test_penalties_and_filters_change_sampling(tiny_runner, tiny_trained):
    engine = make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS)
    prompt = counting_sequence(0, 1)[:3]
    base, top1 = run_all(engine, [
        (prompt, SamplingParams(temperature=0, max_tokens=8)),
        (prompt, SamplingParams(temperature=50.0, top_k=1, max_tokens=8, seed=1)),  # top-k 1 = greedy
    ])
    assert top1.outputs[0].token_ids == base.outputs[0].token_ids
    assert base.outputs[0].token_ids == list(range(2, 10))
    # Past the end of the count (ignore_eos) the model repeats </s>; penalties stop that.
    end = [64, 60, 61]
    plain, frequency, repetition = run_all(engine, [
        (end, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        (end, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)),
        (end, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=5.0)),
    ])
    assert plain.outputs[0].token_ids.count(EOS) >= 3
    assert frequency.outputs[0].token_ids.count(EOS) < plain.outputs[0].token_ids.count(EOS)
    assert len(set(repetition.outputs[0].token_ids)) == 10  # nothing seen may come back
    hot = run_all(engine, [(prompt, SamplingParams(temperature=50.0, max_tokens=8, seed=s)) for s in range(4)])
    assert any(o.outputs[0].token_ids != base.outputs[0].token_ids for o in hot)  # high temperature explores


def test_long_random_workload_compiles_nothing_after_warmup(tiny_runner, tiny_trained):
    rng = np.random.default_rng(1)
    for policy in POLICIES:
        engine = make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS)
        requests = []
        for _ in range(20):
            prompt = rng.integers(0, 64, rng.integers(1, 30)).tolist()
            requests.append((prompt, SamplingParams(
                temperature=float(rng.choice([0.0, 0.7, 2.0])), top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.8])), min_p=float(rng.choice([0.0, 0.1])),
                presence_penalty=float(rng.choice([0.0, 0.5])), logprobs=rng.choice([None, 2]),
                max_tokens=int(rng.integers(1, 40)), ignore_eos=bool(rng.integers(0, 2)), seed=int(rng.integers(0, 99)))))
        run_all(engine, requests)
    assert tiny_runner.num_compilations_after_warmup == 0


def test_finished_only_steps_give_each_final_output_once(tiny_runner, tiny_trained):
    """`step(finished_only=True)` (the offline LLM's loop) returns the finished requests' outputs
    alone, each once, the same as the final outputs of plain steps."""
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=n, logprobs=1)) for p, n in workload()]
    plain = run_all(make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS), requests)
    engine = make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS)
    ids = [engine.add_request(list(p), params) for p, params in requests]
    seen = []
    while engine.has_unfinished_requests():
        outputs = engine.step(finished_only=True)
        assert all(out.finished for out in outputs)
        seen += outputs
    assert sorted(out.request_id for out in seen) == sorted(ids)
    by_id = {out.request_id: out for out in seen}
    for request_id, expected in zip(ids, plain):
        got = by_id[request_id].outputs[0]
        assert (got.token_ids, got.finish_reason, got.logprobs) == (
            expected.outputs[0].token_ids, expected.outputs[0].finish_reason, expected.outputs[0].logprobs)
