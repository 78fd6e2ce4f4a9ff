"""Speculative decoding on real models: n-gram drafts proposed on the device, verified in the ragged
batch. Greedy and seeded outputs equal those without speculation, under every policy and at pp 2;
the sampled distribution is the target's (chi-square); structured outputs stay valid."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from orca_jax.checkpoint.train_tiny import BOS, counting_sequence
from orca_jax.config import SpeculativeConfig
from orca_jax.sampling_params import SamplingParams, StructuredOutputsParams

from ..conftest import SPEC_TOKENS
from .conftest import SMOLLM2_LIMITS, TINY_LIMITS, make_engine, run_all, speculating_equals_plain
from .test_engine_tiny import POLICIES, workload

# Drafts at any batch size: the tests check outputs, not the speed policy.
SPEC = SpeculativeConfig(num_speculative_tokens=SPEC_TOKENS, disable_by_batch_size=64)


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def seeded(max_tokens, seed):
    return SamplingParams(temperature=3.0, top_p=0.95, max_tokens=max_tokens, seed=seed)


def tiny_requests(sampling):
    """The tiny engine tests' workload (mostly no n-gram matches: counting never repeats) plus
    prompts that repeat themselves, so drafts are proposed, some accepted and some rejected."""
    requests = [(p, m) for p, m in workload()]
    requests += [(counting_sequence(s, d)[:6] + counting_sequence(s, d)[1:4], 30) for s, d in [(2, 1), (5, 2), (9, 3)]]
    return [(p, greedy(m) if sampling == "greedy" else seeded(m, 300 + i)) for i, (p, m) in enumerate(requests)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_speculation_on_equals_off_every_policy(tiny_runner, tiny_spec_runner, tiny_trained, policy, sampling):
    # Greedy runs with async scheduling (n-gram steps without drafts are planned ahead). Seeded runs
    # without it: at its temperature the workload proposes only a couple of drafts, which async
    # scheduling does not verify (the step planned ahead in the meantime draws another token).
    limits = TINY_LIMITS | {"async_scheduling": sampling == "greedy"}
    engine, schedules = speculating_equals_plain(tiny_runner, tiny_spec_runner, tiny_trained, policy,
                                                 tiny_requests(sampling), SPEC, limits)
    assert engine.drafts.stats.num_draft_tokens > 0
    if sampling == "greedy" and policy != "static":  # steps without drafts overlapped
        assert engine.in_flight.plans_ahead and engine.in_flight.depths[2] > 0
    # Drafting requests shared steps with requests that verified none (prefills, plain decodes).
    assert any(p.num_draft_tokens and any(not s.draft_token_ids for s in p.scheduled) for p in schedules)
    assert tiny_spec_runner.num_compilations_after_warmup == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_pipeline_of_two_stages_with_speculation_equals_one_stage(tiny_runner, tiny_spec_pp2_runner, tiny_trained,
                                                                  policy):
    for sampling in ["greedy", "seeded"] if policy == "chunked" else ["greedy"]:
        requests = tiny_requests(sampling)
        off = run_all(make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS), requests)
        engine = make_engine(tiny_spec_pp2_runner, tiny_trained, policy, **TINY_LIMITS, speculative_config=SPEC)
        on = run_all(engine, requests)
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
        assert engine.drafts.stats.num_draft_tokens > 0
        if policy != "static":  # a static batch steps as one: nothing to overlap it with
            assert max(engine.in_flight.depths) == 2
    assert tiny_spec_pp2_runner.num_compilations_after_warmup == 0


def test_rejection_sampling_keeps_the_target_distribution(tiny_spec_runner, tiny_trained):
    """Many seeded draws of a token that is verified against a draft: the prompt has the bigram
    "5 7" followed by 9, so after sampling 7 (p ~ 0.43) the n-gram proposer drafts 9, and the next
    token is drawn by verification. Its distribution must be the model's own (where 9 has p ~ 0.18;
    the model prefers 13, having seen 11 13 15 earlier)."""
    temperature, num_draws = 1.0, 400
    prompt = [BOS, 3, 5, 7, 9, 11, 13, 15, 3, 5]
    model = tiny_trained.model
    context = prompt + [7]
    logits = model(jnp.asarray(context), jnp.arange(len(context)), jnp.zeros(len(context), jnp.int32))[-1]
    target = np.asarray(jax_softmax(logits / temperature), np.float64)
    target /= target.sum()  # float32's softmax sums to 1 only within ~1e-7; chisquare checks the sums tighter
    engine = make_engine(tiny_spec_runner, tiny_trained, "chunked", **TINY_LIMITS, speculative_config=SPEC)
    params = [SamplingParams(temperature=temperature, max_tokens=3, seed=10_000 + i) for i in range(num_draws)]
    outputs = run_all(engine, [(prompt, p) for p in params])
    seconds = [o.outputs[0].token_ids[1] for o in outputs if o.outputs[0].token_ids[0] == 7]
    verified = [o for o in outputs if o.outputs[0].token_ids[0] == 7 and o.metrics.num_draft_tokens > 0]
    assert len(seconds) > 120 and len(verified) == len(seconds)  # every one of them verified the draft 9
    assert 0.1 < target[9] < 0.9  # the draft is neither sure to pass nor sure to fail
    observed = np.bincount(seconds, minlength=len(target)).astype(np.float64)
    expected = target * len(seconds)
    common = expected >= 5  # tokens too rare for the test are pooled into one cell
    observed = np.append(observed[common], observed[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    chi2, p_value = stats.chisquare(observed, expected)
    assert p_value > 0.001, (chi2, p_value, observed, expected)


def jax_softmax(x):
    import jax

    return jax.nn.softmax(x)


COPY_TASKS = [
    "Fix the typos in this text and write it out again: The quick brwon fox jumsp over the lazy dog. "
    "The dog was not amused, and the fox ran away into the forets.",
    "Rewrite this Python function with a docstring:\ndef add_numbers(first, second):\n    total = first + second\n"
    "    return total\n",
]


def test_smollm2_copy_tasks_greedy_on_equals_off(smollm2_runner, smollm2_spec_runner, smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": text}])) for text in COPY_TASKS]
    requests = [(p, greedy(32)) for p in prompts] + [(tok.encode("The three laws of thermodynamics are"), greedy(12))]
    off = run_all(make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS), requests)
    engine = make_engine(smollm2_spec_runner, smollm2, "chunked", **SMOLLM2_LIMITS, speculative_config=SPEC)
    on = run_all(engine, requests)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert engine.drafts.stats.acceptance_rate > 0.4  # copying: most drafts are right
    assert on[0].metrics.num_accepted_tokens > 0
    assert smollm2_spec_runner.num_compilations_after_warmup == 0


def test_json_schema_outputs_validate_with_speculation_on(smollm2_runner, smollm2_spec_runner, smollm2):
    """Constrained requests verify only drafts their grammar allows, each row masked by the grammar
    after the drafts before it: outputs valid, and equal to those without speculation."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                                               "age": {"type": "integer"}}, "required": ["name", "city", "age"]}
    tok = smollm2.tokenizer
    text = ('Write this as JSON with the keys name, city and age: {"name": "Ada Lovelace", "city": "London", '
            '"age": 36}')
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    constrained = SamplingParams(temperature=0.0, max_tokens=60,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    requests = [(prompt, constrained), (prompt, greedy(30))]
    off = run_all(make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS), requests)
    engine = make_engine(smollm2_spec_runner, smollm2, "chunked", **SMOLLM2_LIMITS, speculative_config=SPEC)
    on = run_all(engine, requests)
    value = json.loads(on[0].outputs[0].text)
    assert set(value) == {"name", "city", "age"} and isinstance(value["age"], int)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert on[0].metrics.num_accepted_tokens > 0  # the constrained request's drafts passed too
