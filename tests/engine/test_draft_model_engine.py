"""Speculative decoding with a draft model (runner/draft_model.py): greedy outputs equal those without
speculation under every policy and at pp 2, batched with requests that verify no drafts; the draft's
own KV pages stay right through preemption, abort and the prefix cache (a target drafting for itself
has every greedy draft accepted); rejection sampling keeps the target's distribution (chi-square)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from orca_jax.checkpoint.train_tiny import BOS
from orca_jax.config import SpeculativeConfig
from orca_jax.sampling_params import SamplingParams, StructuredOutputsParams

from ..conftest import SPEC_TOKENS
from .conftest import SMOLLM2_LIMITS, TINY_LIMITS, make_engine, run_all, speculating_equals_plain
from .test_engine_tiny import POLICIES
from .test_speculative_engine import COPY_TASKS, greedy, tiny_requests

# Drafts at any batch size: the tests check outputs, not the speed policy.
SPEC = SpeculativeConfig(method="draft_model", model="tiny", num_speculative_tokens=SPEC_TOKENS,
                         disable_by_batch_size=64)


def draft_runner(request, which):
    return request.getfixturevalue(f"tiny_{which}_draft_runner")


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("which", ["self", "noisy"])
def test_greedy_draft_model_on_equals_off_every_policy(request, tiny_runner, tiny_trained, policy, which):
    runner = draft_runner(request, which)
    engine, schedules = speculating_equals_plain(tiny_runner, runner, tiny_trained, policy, tiny_requests("greedy"),
                                                 SPEC, TINY_LIMITS)
    stats_ = engine.drafts.stats
    assert stats_.num_draft_tokens > 50
    if which == "self":
        assert stats_.acceptance_rate == 1.0  # its own drafts: its KV pages hold what the target's do
        # All k drafts at once (1-token pages): the slots its proposals write ahead were allocated.
        assert max(len(s.draft_token_ids) for p in schedules for s in p.scheduled) == SPEC_TOKENS
    else:
        assert 0.1 < stats_.acceptance_rate < 0.9
    # Drafting requests shared steps with requests that verified none (prefills, decodes near their end);
    # a static batch prefills apart and then decodes as one, each member drafting.
    mixed = any(p.num_draft_tokens and any(not s.draft_token_ids for s in p.scheduled) for p in schedules)
    assert mixed or policy == "static"
    assert runner.num_compilations_after_warmup == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_pipeline_of_two_stages_with_a_draft_model_equals_one_stage(tiny_runner, tiny_noisy_draft_pp2_runner,
                                                                    tiny_trained, policy):
    requests = tiny_requests("greedy")
    off = run_all(make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS), requests)
    engine = make_engine(tiny_noisy_draft_pp2_runner, tiny_trained, policy, **TINY_LIMITS, speculative_config=SPEC)
    on = run_all(engine, requests)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert engine.drafts.stats.num_accepted_tokens > 0
    if policy != "static":
        assert max(engine.in_flight.depths) == 2
    assert tiny_noisy_draft_pp2_runner.num_compilations_after_warmup == 0


def test_draft_kv_survives_preemption_abort_and_prefix_cache(tiny_trained):
    """A small cache (preemptions under paged / chunked), aborts while drafts are in flight, shared
    prefixes: every page comes back, outputs equal speculation off, and a target drafting for itself
    still has every draft accepted, so the draft's K/V of recomputed and prefix-cached tokens are right."""
    from ..conftest import draft_proposer, warm_tiny_runner

    off_runner = warm_tiny_runner(tiny_trained, "xla", num_pages=24)
    runner = warm_tiny_runner(tiny_trained, "xla", proposer=draft_proposer("tiny", tiny_trained), num_pages=24)
    shared = [BOS, 3, 5, 7, 9, 11, 13, 15, 17]  # two full pages shared by several prompts
    requests = [(shared + [19 + 2 * i], greedy(40)) for i in range(6)] + tiny_requests("greedy")[:6]
    for policy in ["paged", "chunked"]:
        off = run_all(make_engine(off_runner, tiny_trained, policy, prefix_caching=True, **TINY_LIMITS), requests)
        engine = make_engine(runner, tiny_trained, policy, prefix_caching=True, **TINY_LIMITS,
                             speculative_config=SPEC)
        on = run_all(engine, requests)  # asserts every page came back
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.prefix_cache_hits > 0
        assert engine.drafts.stats.num_draft_tokens > 50 and engine.drafts.stats.acceptance_rate == 1.0

        # Aborts while a step with drafts is in flight.
        ids = [engine.add_request(list(p), params) for p, params in requests]
        for step in range(12):
            engine.step()
            if step in (4, 8):
                for request_id in ids[step // 4::3]:
                    engine.abort(request_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.kv.num_free_pages == engine.kv.num_pages
    assert runner.num_compilations_after_warmup == 0


def test_rejection_sampling_against_a_draft_model_keeps_the_target_distribution(tiny_noisy_draft_runner,
                                                                                tiny_trained, tiny_noisy_draft):
    """Many seeded draws of the second output token, which is verified against a draft drawn from the
    noisy draft's q (another model, at twice the temperature): its distribution must be the target's p,
    not q. Draws whose first token is the likeliest one are counted (one context, one p)."""
    temperature, num_draws = 1.0, 400
    prompt = [BOS, 3, 5, 7, 9, 11, 13, 15, 3, 5]
    model = tiny_trained.model

    def next_distribution(model, context):
        logits = model(jnp.asarray(context), jnp.arange(len(context)), jnp.zeros(len(context), jnp.int32))[-1]
        return np.asarray(jax.nn.softmax(logits / temperature), np.float64)

    first = int(np.argmax(next_distribution(model, prompt)))
    target = next_distribution(model, prompt + [first])
    draft = next_distribution(tiny_noisy_draft.model, prompt + [first])
    assert 0.5 * np.abs(target - draft).sum() > 0.2  # q is far from p: accepting drafts blindly would show
    engine = make_engine(tiny_noisy_draft_runner, tiny_trained, "chunked", **TINY_LIMITS, speculative_config=SPEC)
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=20_000 + i) for i in range(num_draws)]
    outputs = run_all(engine, [(prompt, p) for p in params])
    kept = [o for o in outputs if o.outputs[0].token_ids[0] == first]
    assert len(kept) > 100 and all(o.metrics.num_draft_tokens > 0 for o in kept)  # each verified a draft
    accepted = sum(o.metrics.num_accepted_tokens > 0 for o in kept)
    assert 0.1 * len(kept) < accepted < 0.9 * len(kept)  # drafts both passed and failed
    seconds = [o.outputs[0].token_ids[1] for o in kept]
    observed = np.bincount(seconds, minlength=len(target)).astype(np.float64)
    for distribution, should_match in ((target, True), (draft, False)):
        expected = distribution * len(seconds)
        common = expected >= 5  # tokens too rare for the test are pooled into one cell
        obs = np.append(observed[common], observed[~common].sum())
        exp = np.append(expected[common], expected[~common].sum())
        _, p_value = stats.chisquare(obs, exp * obs.sum() / exp.sum())
        assert (p_value > 0.001) == should_match, (should_match, p_value, obs, exp)


def test_smollm2_drafting_for_itself_greedy_on_equals_off(smollm2_runner, smollm2_self_draft_runner, smollm2):
    """Acceptance ~100% (a draft that is the target); a json_schema request among them stays valid
    (its drafts are cut to what its grammar allows, as with n-grams)."""
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])) for text in COPY_TASKS]
    requests = [(p, greedy(24)) for p in prompts] + [(tok.encode("The three laws of thermodynamics are"), greedy(12))]
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    ask = 'Write as JSON: {"name": "Ada", "age": 36}'
    json_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": ask}]))
    requests.append((json_prompt, SamplingParams(temperature=0.0, max_tokens=30,
                                                 structured_outputs=StructuredOutputsParams(json=schema))))
    for policy in POLICIES:
        off = run_all(make_engine(smollm2_runner, smollm2, policy, **SMOLLM2_LIMITS), requests)
        engine = make_engine(smollm2_self_draft_runner, smollm2, policy, **SMOLLM2_LIMITS,
                             speculative_config=SPEC)
        on = run_all(engine, requests)
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
        assert engine.drafts.stats.num_draft_tokens > 20 and engine.drafts.stats.acceptance_rate > 0.95
        assert set(json.loads(on[-1].outputs[0].text)) == {"name", "age"} and on[-1].metrics.num_accepted_tokens > 0
    assert smollm2_self_draft_runner.num_compilations_after_warmup == 0


def test_llm_with_a_draft_model_checkpoint_halves_the_pages_and_keeps_the_outputs():
    """Through the builder, as users build it: the draft model named by its checkpoint, its KV
    pages beside the target's in the same budget (the tiny target drafting for itself: half the
    pages each), greedy outputs equal speculation off."""
    from orca_jax import LLM

    # One bucket each way (not the default doublings): the builder path is what this tests, and each
    # bucket costs the target's and the draft's programs a compilation.
    limits = dict(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory=1 << 20, show_progress=False,
                  token_buckets=(32,), seq_buckets=(4,))
    prompts = [{"prompt_token_ids": p} for p in ([BOS, 3, 5, 7], [BOS, 2, 4], [BOS, 9, 12, 15, 18])]
    off = LLM("tiny", **limits)
    on = LLM("tiny", speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3},
             **limits)
    assert on.runner.num_pages == off.runner.num_pages // 2
    assert "draft model tiny" in on.runner.describe()
    params = SamplingParams(temperature=0.0, max_tokens=20)
    expected = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    outputs = on.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(o.metrics.num_accepted_tokens for o in outputs) > 10
    assert on.num_compilations_after_warmup == 0
