"""The engine with the kernels (the Pallas kernel in interpret mode on CPU, the native C++ kernel):
the batch-invariance promise holds for every policy, and the tokens equal those of the XLA attention."""

import pytest

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.sampling_params import SamplingParams

from .conftest import TINY_LIMITS, make_engine, run_all
from .test_engine_tiny import workload

POLICIES = ["static", "orca", "paged", "chunked"]


@pytest.fixture(scope="module", params=["pallas-interpret", "native"])
def kernel_runner(request):
    return request.getfixturevalue({"pallas-interpret": "tiny_pallas_runner", "native": "tiny_native_runner"}[request.param])


@pytest.fixture(scope="module")
def requests():
    return [(p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in workload()]


@pytest.fixture(scope="module")
def solo_tokens(kernel_runner, tiny_trained, requests):
    return [run_all(make_engine(kernel_runner, tiny_trained, "chunked", **TINY_LIMITS), [r])[0].outputs[0].token_ids
            for r in requests]


@pytest.mark.parametrize("policy", POLICIES)
def test_batched_equals_solo_and_xla(kernel_runner, tiny_runner, tiny_trained, requests, solo_tokens, policy):
    batched = run_all(make_engine(kernel_runner, tiny_trained, policy, **TINY_LIMITS), requests)
    assert [o.outputs[0].token_ids for o in batched] == solo_tokens
    xla = run_all(make_engine(tiny_runner, tiny_trained, policy, **TINY_LIMITS), requests)
    assert [o.outputs[0].token_ids for o in xla] == solo_tokens
    for (prompt, _), tokens in zip(requests, solo_tokens):  # and they are right
        step = prompt[2] - prompt[1]
        assert tokens == counting_sequence(prompt[1], step)[len(prompt):len(prompt) + len(tokens)]
    assert kernel_runner.num_compilations_after_warmup == 0
