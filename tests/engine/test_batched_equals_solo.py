"""Batched == solo over every runner (docs/numerics.md, "Batch invariance"): each case names its
runner (a session fixture of tests/conftest.py, compiled once and shared with the other tests), its
workloads, the policies it runs under and how close a batched request must stay to its solo run.
Solo runs go through the chunked policy once per case and workload (one request alone is scheduled
alike by every policy) and are shared by the case's policies.

The `gpu` cases run the engine on a GPU (Pallas attention, float32 at matmul precision "highest"):
skipped, with the reason, where there is none; bench/gpu_run.sh runs them with tests/gpu.

Elsewhere: tests/gpu/test_gpu.py (SmolLM2 in bfloat16 on a GPU, whose near-ties are not bounded in
number as Tolerance's are), tests/server/test_structured_outputs.py (through the server, constrained
and free requests together) and tests/checkpoint/test_hf_families.py (each family's tokens against
transformers', batched and alone)."""

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from orca_jax.checkpoint.train_tiny import counting_sequence

from .conftest import (BFLOAT16_MAX_DRIFT, BFLOAT16_PAGES_MAX_DRIFT, EQUAL, SMOLLM2_LIMITS, TINY_LIMITS, Tolerance,
                       check_batched_equals_solo, greedy_with_logprobs, make_engine, run_solo)
from .test_draft_model_engine import SPEC as DRAFT_MODEL_SPEC
from .test_engine_smollm2 import gpu_requests, smollm2_requests
from .test_engine_smollm2 import workload as smollm2_workload
from .test_engine_tiny import POLICIES, greedy, seeded
from .test_engine_tiny import workload as tiny_workload
from .test_speculative_engine import SPEC as NGRAM_SPEC
from .test_speculative_engine import tiny_requests


def smollm2_prompts(request):
    return smollm2_requests(request.getfixturevalue("smollm2").tokenizer, request.getfixturevalue("smollm2_reference"))


# Workloads: FixtureRequest -> [(prompt_token_ids, SamplingParams)].
WORKLOADS = {
    # The counting model's prompts: more requests than slots, lengths around the page size.
    "count-greedy": lambda request: [(p, greedy(m)) for p, m in tiny_workload()],
    "count-seeded": lambda request: [(p, seeded(m, 100 + i)) for i, (p, m) in enumerate(tiny_workload())],
    "count-greedy-logprobs": lambda request: [(p, greedy_with_logprobs(m)) for p, m in tiny_workload()],
    # Prompts that repeat themselves join the counting ones: drafts are proposed, some rejected.
    "repeats-seeded": lambda request: tiny_requests("seeded"),
    # SmolLM2: reference prompts and others, 9 requests for 8 slots.
    "prompts-greedy": lambda request: smollm2_workload(smollm2_prompts(request), "greedy"),
    "prompts-seeded": lambda request: smollm2_workload(smollm2_prompts(request), "seeded"),
    # Outputs capped at 8 tokens: bfloat16 is slow on XLA:CPU, and quantized models need no more.
    "prompts-short": lambda request: [(p, greedy_with_logprobs(min(m, 8))) for p, m in smollm2_prompts(request)],
    # The GPU tests' SmolLM2 requests (tests/gpu/test_gpu.py).
    "gpu-prompts-greedy": lambda request: gpu_requests(request.getfixturevalue("smollm2").tokenizer,
                                                       request.getfixturevalue("smollm2_reference")),
    # Random prompts over Llama-3-8B's vocabulary, of 1 to 100 tokens.
    "random-greedy": lambda request: random_requests(request.getfixturevalue("llama3_8b_dummy").config.vocab_size),
}


def random_requests(vocab_size):
    rng = np.random.default_rng(0)
    return [(rng.integers(0, vocab_size, n).tolist(), greedy_with_logprobs(m))
            for n, m in [(5, 12), (40, 7), (100, 16), (1, 9), (63, 11)]]


def greedy_tokens_count_on(requests, batched, solo):
    """The counting model's greedy continuations are right: each kernel gives XLA's tokens."""
    for (prompt, params), out in zip(requests, batched):
        if params.temperature == 0:
            tokens = out.outputs[0].token_ids
            step = prompt[2] - prompt[1]
            assert tokens == counting_sequence(prompt[1], step)[len(prompt):len(prompt) + len(tokens)]


def the_layers_matter(requests, batched, solo):
    """The random weights' layers matter: the solo runs give more than 5 distinct tokens, not one on repeat."""
    assert len({t for o in solo for t in o.outputs[0].token_ids}) > 5


def solo_runs_verified_drafts(requests, batched, solo):
    """The draft model drafts for the requests alone too (the last four: three that repeat themselves)."""
    assert all(o.metrics.num_draft_tokens > 0 for o in solo[-4:])


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    runner: str  # the session fixture of the warmed-up runner
    model: str  # the session fixture of the loaded model it serves
    engine: dict  # make_engine's keywords: limits, speculative_config
    workloads: tuple[str, ...]  # names in WORKLOADS
    policies: tuple[str, ...] = tuple(POLICIES)
    tolerance: Tolerance = EQUAL
    check: Callable | None = None  # anything else this case asserts: (requests, batched, solo)
    heavy: bool = False  # left out of `make test-fast` (tests/conftest.py)
    gpu: bool = False  # needs a GPU (its runner's fixture is on one)


CASES = [
    Case("tiny-xla", "tiny_runner", "tiny_trained", TINY_LIMITS, ("count-greedy", "count-seeded"),
         check=greedy_tokens_count_on),
    Case("tiny-native", "tiny_native_runner", "tiny_trained", TINY_LIMITS, ("count-greedy", "count-seeded"),
         check=greedy_tokens_count_on),
    Case("tiny-pallas-interpret", "tiny_pallas_runner", "tiny_trained", TINY_LIMITS, ("count-greedy",),
         check=greedy_tokens_count_on, heavy=True),
    # The counting model is sure of every token (no near-ties): no request leaves its path.
    Case("tiny-bf16", "tiny_bf16_runner", "tiny_bf16", TINY_LIMITS, ("count-greedy-logprobs",), ("chunked",),
         Tolerance(BFLOAT16_MAX_DRIFT), heavy=True),
    Case("tiny-ngram", "tiny_spec_runner", "tiny_trained", TINY_LIMITS | {"speculative_config": NGRAM_SPEC},
         ("repeats-seeded",), ("chunked",), heavy=True),
    Case("tiny-draft-model", "tiny_noisy_draft_runner", "tiny_trained",
         TINY_LIMITS | {"speculative_config": DRAFT_MODEL_SPEC}, ("repeats-seeded",), ("chunked",),
         check=solo_runs_verified_drafts, heavy=True),
    Case("smollm2", "smollm2_runner", "smollm2", SMOLLM2_LIMITS, ("prompts-greedy", "prompts-seeded")),
    Case("smollm2-bf16", "smollm2_bf16_runner", "smollm2_bf16", SMOLLM2_LIMITS, ("prompts-short",), ("chunked",),
         Tolerance(BFLOAT16_MAX_DRIFT, near_ties=True), heavy=True),
    # float32 activations, bfloat16 KV pages.
    Case("smollm2-bf16-pages", "smollm2_bf16_kv_runner", "smollm2", SMOLLM2_LIMITS, ("prompts-short",), ("chunked",),
         Tolerance(BFLOAT16_PAGES_MAX_DRIFT, near_ties=True)),
    # Quantized: the native matmul sums each output in a fixed order whatever the batch. `gguf` takes
    # int8 activations (its default; the native kernel takes the prefills too), `int8` weights float32
    # ones (the same engine path, the float kernel), under the default policy only.
    Case("smollm2-gguf", "smollm2_gguf_runner", "smollm2_gguf", SMOLLM2_LIMITS, ("prompts-short",)),
    Case("smollm2-int8", "smollm2_int8_runner", "smollm2_int8", SMOLLM2_LIMITS, ("prompts-short",), ("chunked",)),
    # On a GPU: the committed tiny model (needs no download); Llama-3-8B's shapes at 2 layers with
    # random weights made on the GPU (nothing carried); SmolLM2, where its checkpoint is (a lent GPU
    # machine has none: skipped, with the reason).
    Case("gpu-tiny", "tiny_gpu_runner", "tiny_trained", TINY_LIMITS, ("count-greedy",), gpu=True),
    Case("gpu-llama3-8b-dummy", "llama3_8b_dummy_gpu_runner", "llama3_8b_dummy",
         {"max_num_seqs": 8, "max_num_batched_tokens": 128}, ("random-greedy",), ("chunked",),
         check=the_layers_matter, gpu=True),
    Case("gpu-smollm2", "smollm2_gpu_runner", "smollm2", SMOLLM2_LIMITS, ("gpu-prompts-greedy",), ("chunked",),
         gpu=True),
]


def matrix():
    for case in CASES:
        # Fixtures reached through getfixturevalue are out of sight of tests/conftest.py's markers.
        marks = (([pytest.mark.slow] if "smollm2" in case.runner else []) + ([pytest.mark.heavy] if case.heavy else [])
                 + ([pytest.mark.gpu] if case.gpu else []))
        for workload in case.workloads:
            for policy in case.policies:
                yield pytest.param(case, workload, policy, marks=marks, id=f"{case.name}-{workload}-{policy}")


@pytest.fixture(scope="module")
def solo_runs():
    """(case name, workload) -> its solo outputs, run by the first of its tests."""
    return {}


@pytest.mark.parametrize("case, workload, policy", list(matrix()))
def test_batched_equals_solo(case, workload, policy, request, solo_runs):
    runner, loaded = request.getfixturevalue(case.runner), request.getfixturevalue(case.model)
    requests = WORKLOADS[workload](request)
    if (case.name, workload) not in solo_runs:
        solo_runs[case.name, workload] = run_solo(lambda: make_engine(runner, loaded, "chunked", **case.engine),
                                                  requests)
    solo = solo_runs[case.name, workload]
    batched = check_batched_equals_solo(make_engine(runner, loaded, policy, **case.engine), requests, solo,
                                        case.tolerance)
    if case.check is not None:
        case.check(requests, batched, solo)
    assert runner.num_compilations_after_warmup == 0
