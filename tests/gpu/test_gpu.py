"""On a GPU: the compiled Pallas kernels against the reference at Llama-3-8B / 13B-like shapes, and
the engine on the real SmolLM2 (the HF reference's greedy tokens; bfloat16 batched against solo; tp
over the GPUs). Batched == solo in float32 on the GPU (the committed tiny model, Llama-3-8B-shaped
random weights made on the GPU, SmolLM2) is in tests/engine/test_batched_equals_solo.py's matrix, as
`gpu` cases. Skipped, with the reason, on a machine without a GPU (tests/conftest.py);
bench/gpu_run.sh and bench/gpu_check.py run them. The SmolLM2 tests also skip where its checkpoint is
absent (tests/conftest.py's smollm2_here): the GPU machine lent for a run has no network and takes at
most 64 MiB along, and SmolLM2's converted checkpoint is 337 MB (its GGUF 98 MB).

What is guaranteed per dtype (docs/numerics.md): float32 (matmul precision "highest": no TF32) gives the
reference's greedy tokens and, batched, each request's solo tokens with logprobs within
FLOAT32_MAX_DRIFT; bfloat16 gives each request's solo path with logprobs within BFLOAT16_MAX_DRIFT,
parting only at a near-tie."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.sampling_params import SamplingParams
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference

from ..conftest import gpu_devices, warm_gpu_runner
from ..engine.conftest import BFLOAT16_MAX_DRIFT, FLOAT32_MAX_DRIFT, SMOLLM2_LIMITS, diverging_requests, make_engine, run_all
from ..engine.test_engine_smollm2 import gpu_requests
from ..pallas_kernels.test_ragged_paged_attention import lengths, make_batch

pytestmark = pytest.mark.gpu

# (query heads, KV heads, head_dim): Llama-3-8B (GQA 4:1) and a Llama-2-13B-like one (40 heads, MHA).
SHAPES = {"llama3-8b": (32, 8, 128), "llama2-13b": (40, 40, 128)}
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_compiled_kernel_matches_the_reference(shape, kind, dtype):
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    decodes = [(n, 1) for n in lengths(16)] + [(700, 1)]
    prefills = [(n, n) for n in lengths(16)] + [(50, 17)]
    seqs = {"decode": decodes, "prefill": prefills, "mixed": decodes + prefills}[kind]
    rng = np.random.default_rng(len(seqs) * num_heads)
    args = make_batch(rng, page_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      seqs=seqs, dtype=dtype)
    args = jax.device_put(args, gpu_devices()[0])
    scale = head_dim ** -0.5
    got = np.asarray(ragged_paged_attention(*args, sm_scale=scale), np.float32)
    with jax.default_matmul_precision("highest"):  # the oracle in full float32, not TF32
        want = np.asarray(ragged_paged_attention_reference(*args, sm_scale=scale), np.float32)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.fixture(scope="module")
def bf16_runner(smollm2_here, smollm2_bf16):
    return warm_gpu_runner(smollm2_bf16)


def test_smollm2_float32_gives_the_reference_greedy_tokens(smollm2_gpu_runner, smollm2, smollm2_reference):
    cases = smollm2_reference["cases"]
    engine = make_engine(smollm2_gpu_runner, smollm2, "chunked", **SMOLLM2_LIMITS)
    outputs = run_all(engine, [(c["prompt_ids"], SamplingParams(temperature=0, max_tokens=len(c["greedy_ids"])))
                               for c in cases])
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy_ids"] for c in cases]


def test_bfloat16_batched_leaves_the_solo_path_only_at_near_ties(smollm2_here, smollm2_bf16, bf16_runner,
                                                                  smollm2_reference):
    """(Not in tests/engine/test_batched_equals_solo.py's matrix with the float32 GPU cases: its
    near-tie rule also bounds how many requests may part, at a third; this one does not.)"""
    work = gpu_requests(smollm2_bf16.tokenizer, smollm2_reference)
    solo = [run_all(make_engine(bf16_runner, smollm2_bf16, "chunked", **SMOLLM2_LIMITS), [r])[0] for r in work]
    engine = make_engine(bf16_runner, smollm2_bf16, "chunked", **SMOLLM2_LIMITS)
    batched = run_all(engine, work)
    assert engine.num_steps < sum(len(o.outputs[0].token_ids) for o in solo)  # requests did share steps
    diverging_requests(batched, solo, max_drift=BFLOAT16_MAX_DRIFT)  # asserts near-ties only
    assert bf16_runner.num_compilations_after_warmup == 0


def test_tensor_parallel_over_the_gpus_matches_one_gpu(smollm2_gpu_runner, smollm2, smollm2_reference):
    runner = warm_gpu_runner(smollm2, tp=3)  # SmolLM2's 9 / 3 heads split at tp 3 only
    work = gpu_requests(smollm2.tokenizer, smollm2_reference)
    one = run_all(make_engine(smollm2_gpu_runner, smollm2, "chunked", **SMOLLM2_LIMITS), work)
    split = run_all(make_engine(runner, smollm2, "chunked", **SMOLLM2_LIMITS), work)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in one]
    assert diverging_requests(split, one, max_drift=FLOAT32_MAX_DRIFT) == []
