"""The engine on the real SmolLM2 weights: the reference greedy continuations, and async scheduling
against steps taken one at a time (batched == solo: test_batched_equals_solo.py)."""

import pytest

from orca_jax.sampling_params import SamplingParams

from .conftest import FLOAT32_MAX_DRIFT, SMOLLM2_LIMITS, diverging_requests, greedy_with_logprobs, make_engine, run_all

EXTRA_PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef softmax(x):",
    "The three laws of thermodynamics are",
    "List of prime numbers: 2, 3, 5, 7,",
    "Q: What is the boiling point of water at sea level?\nA:",
    "In 1969, the first humans",
]


def smollm2_requests(tokenizer, smollm2_reference, extra_prompts=EXTRA_PROMPTS) -> list[tuple[list[int], int]]:
    """Reference prompts plus others: 9 requests for 8 slots, prompt lengths 5..35 tokens (around
    the page size of 16), outputs of 3..20 tokens: [(prompt_token_ids, max_tokens)]."""
    prompts = [c["prompt_ids"] for c in smollm2_reference["cases"]]
    prompts += [tokenizer.encode(p) for p in extra_prompts]
    return [(p, 3 + (7 * i) % 18) for i, p in enumerate(prompts)]


# The GPU tests' requests (tests/gpu/test_gpu.py, and test_batched_equals_solo.py's float32 GPU
# case): the reference prompts and three short ones, each greedy with logprobs.
GPU_EXTRA_PROMPTS = ("Once upon a time,", "def softmax(x):", "In 1969, the first")


def gpu_requests(tokenizer, smollm2_reference):
    return [(p, greedy_with_logprobs(m)) for p, m in smollm2_requests(tokenizer, smollm2_reference, GPU_EXTRA_PROMPTS)]


@pytest.fixture(scope="module")
def requests(smollm2, smollm2_reference):
    return smollm2_requests(smollm2.tokenizer, smollm2_reference)


def test_engine_greedy_matches_the_reference(smollm2, smollm2_runner, smollm2_reference):
    cases = smollm2_reference["cases"]
    engine = make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS)
    outputs = run_all(engine, [(c["prompt_ids"], SamplingParams(temperature=0, max_tokens=len(c["greedy_ids"])))
                               for c in cases])
    for case, out in zip(cases, outputs):
        assert out.outputs[0].token_ids == case["greedy_ids"]
        assert out.outputs[0].text == case["greedy_text"].removesuffix("<|im_end|>")


def workload(requests, sampling):
    return [(p, greedy_with_logprobs(m) if sampling == "greedy"
             else SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=m, seed=i))
            for i, (p, m) in enumerate(requests)]


@pytest.mark.parametrize("policy", ["orca", "chunked"])
def test_async_scheduling_gives_the_outputs_of_steps_taken_one_at_a_time(smollm2, smollm2_runner, requests, policy):
    """Greedy and seeded requests together, with stop tokens among them: steps planned ahead on
    tokens fed on the device give every output (tokens, logprobs, finish reason) of the engine that
    waits for each step."""
    stops = [SamplingParams(temperature=0.0, max_tokens=m, stop_token_ids=[13, 30]) for _, m in requests[:3]]
    mixed = workload(requests, "greedy")[3:6] + workload(requests, "seeded")[6:] + list(zip(
        [p for p, _ in requests[:3]], stops))
    results = {}
    for async_scheduling in (False, True):
        engine = make_engine(smollm2_runner, smollm2, policy, **SMOLLM2_LIMITS, async_scheduling=async_scheduling)
        results[async_scheduling] = run_all(engine, mixed)
        assert max(engine.in_flight.depths) == (2 if async_scheduling else 1)
    for off, on in zip(results[False], results[True], strict=True):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert on.outputs[0].finish_reason == off.outputs[0].finish_reason
    # The greedy ones carry logprobs: equal up to batch-composition rounding (steps planned ahead can
    # group requests differently; float32, docs/numerics.md).
    assert diverging_requests(results[True][:3], results[False][:3], max_drift=FLOAT32_MAX_DRIFT) == []
    assert any(o.outputs[0].finish_reason == "stop" for o in results[True])
    assert smollm2_runner.num_compilations_after_warmup == 0
