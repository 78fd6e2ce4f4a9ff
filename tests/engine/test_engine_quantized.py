"""The engine serving quantized SmolLM2 (`gguf`: the GGUF's Q4_1/Q8_0 blocks with int8 activations,
the default; `int8` weights with float32 activations): a request batched follows its solo run,
greedy: the same tokens, logprobs within float32's rounding drift. The native matmul sums each output
in a fixed order whatever the batch (and with int8 activations takes the prefills too), so only the
XLA parts of a step (norms, rotary, sampler) can differ with it. `gguf` runs under every policy;
`int8` (the same engine path, the float32-activation kernel) under the default policy, to keep the
suite's time."""

import pytest

from .conftest import FLOAT32_MAX_DRIFT, SMOLLM2_LIMITS, diverging_requests, greedy_with_logprobs, make_engine, run_all
from .test_engine_smollm2 import POLICIES, requests  # noqa: F401 - the module fixture of SmolLM2 prompts

pytestmark = pytest.mark.slow  # SmolLM2, reached through request.getfixturevalue (conftest cannot see it)

MAX_TOKENS = 8  # of each request's 3..20: enough steps shared in a batch, fewer solo steps


@pytest.fixture(scope="module")
def workload(requests):  # noqa: F811 - the imported fixture
    return [(p, greedy_with_logprobs(min(m, MAX_TOKENS))) for p, m in requests]


@pytest.fixture(scope="module")
def solo(request, workload):
    """Per quantization, each request run alone (one engine per request)."""
    cache = {}

    def outputs(quantization):
        if quantization not in cache:
            loaded = request.getfixturevalue(f"smollm2_{quantization}")
            runner = request.getfixturevalue(f"smollm2_{quantization}_runner")
            cache[quantization] = [run_all(make_engine(runner, loaded, "chunked", **SMOLLM2_LIMITS), [r])[0]
                                   for r in workload]
        return cache[quantization]

    return outputs


@pytest.mark.parametrize("quantization, policy", [("gguf", p) for p in POLICIES] + [("int8", "chunked")])
def test_quantized_batched_equals_solo(request, workload, solo, quantization, policy):
    loaded = request.getfixturevalue(f"smollm2_{quantization}")
    runner = request.getfixturevalue(f"smollm2_{quantization}_runner")
    alone = solo(quantization)
    engine = make_engine(runner, loaded, policy, **SMOLLM2_LIMITS)
    batched = run_all(engine, workload)
    assert engine.num_steps < sum(len(o.outputs[0].token_ids) for o in alone)  # requests did share steps
    assert [out.outputs[0].token_ids for out in batched] == [o.outputs[0].token_ids for o in alone]
    assert diverging_requests(batched, alone, max_drift=FLOAT32_MAX_DRIFT) == []
    assert runner.num_compilations_after_warmup == 0
