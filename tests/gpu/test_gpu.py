"""On a GPU: the compiled Pallas kernels against the reference at Llama-3-8B / 13B-like shapes, the
engine on weights that need no download (the committed tiny model; Llama-3-8B-shaped random weights
made on the GPU) and on the real SmolLM2 (the HF reference's greedy tokens, batched == solo, tp over
the GPUs). Skipped, with the reason, on a machine without a GPU (tests/conftest.py); bench/gpu_run.sh
and bench/gpu_check.py run them. The SmolLM2 tests also skip where its checkpoint is absent: the GPU
machine lent for a run has no network and takes at most 64 MiB along, and SmolLM2's converted
checkpoint is 337 MB (its GGUF 98 MB).

What is guaranteed per dtype (docs/numerics.md): float32 (matmul precision "highest": no TF32) gives the
reference's greedy tokens and, batched, each request's solo tokens with logprobs within
FLOAT32_MAX_DRIFT; bfloat16 gives each request's solo path with logprobs within BFLOAT16_MAX_DRIFT,
parting only at a near-tie."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.checkpoint.dummy import DummyWeights
from orca_jax.config import REPO_ROOT, CacheConfig, EngineConfig, SchedulerConfig, load_model_preset
from orca_jax.engine.engine import LLMEngine
from orca_jax.engine.step_plan import Buckets
from orca_jax.engine_args import config_from_keywords
from orca_jax.model.decoder import abstract_decoder
from orca_jax.runner.model_runner import ModelRunner
from orca_jax.sampling_params import SamplingParams
from pallas_kernels import ragged_paged_attention, ragged_paged_attention_reference

from ..conftest import SMOLLM2, gpu_devices
from ..engine.conftest import (BFLOAT16_MAX_DRIFT, FLOAT32_MAX_DRIFT, SMOLLM2_LIMITS, diverging_requests,
                               greedy_with_logprobs, make_engine, run_all)
from ..engine.conftest import TINY_LIMITS
from ..engine.test_engine_tiny import workload as tiny_workload
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


def gpu_runner(loaded, tp=1, buckets=Buckets(tokens=(32, 128), seqs=(8,)), max_model_len=2048):
    devices = gpu_devices()
    if len(devices) < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs, this machine has {len(devices)}")
    runner = ModelRunner(loaded.model, config_from_keywords(page_size=16, tensor_parallel_size=tp), num_pages=96,
                         max_model_len=max_model_len, buckets=buckets, devices=devices[:tp])
    runner.warm_up(show_progress=False)
    return runner


def test_tiny_model_batched_equals_solo_under_every_policy(tiny_trained):
    """The committed tiny model (needs no download): the engine on the GPU, Pallas attention, f32."""
    runner = gpu_runner(tiny_trained, buckets=Buckets(tokens=(16, 64), seqs=(4, 8)), max_model_len=128)
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    work = [(p, SamplingParams(temperature=0.0, max_tokens=m)) for p, m in tiny_workload()]
    solo = [run_all(make_engine(runner, tiny_trained, "chunked", **TINY_LIMITS), [r])[0] for r in work]
    for policy in ("static", "orca", "paged", "chunked"):
        batched = run_all(make_engine(runner, tiny_trained, policy, **TINY_LIMITS), work)
        assert [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids for s in solo], policy
    assert runner.num_compilations_after_warmup == 0


def test_llama3_8b_shaped_random_model_batched_equals_solo_in_float32():
    """Nothing carried: Llama-3-8B's shapes (GQA 32:8 x 128, d 4096, d_ff 14336, 128256 tokens) at 2
    of its 32 layers, seeded random weights made on the GPU (`--load-format dummy`, scaled so the top
    token leads by far more than rounding), float32 at matmul precision "highest": each request's
    greedy tokens batched are its solo tokens, logprobs within FLOAT32_MAX_DRIFT."""
    config = dataclasses.replace(load_model_preset("llama-3-8b"), n_layers=2, dtype="float32")
    runner = ModelRunner(abstract_decoder(config), config_from_keywords(page_size=16), num_pages=64, max_model_len=256,
                         buckets=Buckets(tokens=(16, 128), seqs=(8,)), devices=gpu_devices()[:1],
                         weights=DummyWeights(seed=0))
    runner.warm_up(show_progress=False)
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    rng = np.random.default_rng(0)
    work = [(rng.integers(0, config.vocab_size, n).tolist(), greedy_with_logprobs(m))
            for n, m in [(5, 12), (40, 7), (100, 16), (1, 9), (63, 11)]]

    def engine():
        scheduler = SchedulerConfig(policy="chunked", max_num_seqs=8, max_num_batched_tokens=128)
        return LLMEngine(EngineConfig(model=config.name, cache=CacheConfig(page_size=16), scheduler=scheduler),
                         config, runner, None, max_model_len=256)

    solo = [run_all(engine(), [r])[0] for r in work]
    batched_engine = engine()
    batched = run_all(batched_engine, work)
    assert batched_engine.num_steps < sum(len(o.outputs[0].token_ids) for o in solo)  # requests did share steps
    assert [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids for s in solo]
    assert diverging_requests(batched, solo, max_drift=FLOAT32_MAX_DRIFT) == []
    assert len({t for o in solo for t in o.outputs[0].token_ids}) > 5  # the layers matter: not one token on repeat
    assert runner.num_compilations_after_warmup == 0


@pytest.fixture(scope="module")
def smollm2_here():
    """SmolLM2 cannot travel to the GPU machine lent for a run: say so instead of trying to pull it."""
    if not (REPO_ROOT / "checkpoints" / SMOLLM2 / "model.toml").is_file():
        pytest.skip(f"checkpoints/{SMOLLM2} is not on this machine: a lent GPU machine has no network to pull it "
                    "and takes at most 64 MiB along (the converted checkpoint is 337 MB); where it can be "
                    f"copied or pulled (`orca-jax pull {SMOLLM2}`), these tests run")


@pytest.fixture(scope="module")
def f32_runner(smollm2_here, smollm2):
    runner = gpu_runner(smollm2)
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    return runner


@pytest.fixture(scope="module")
def bf16_runner(smollm2_here, smollm2_bf16):
    return gpu_runner(smollm2_bf16)


def requests(loaded, reference):
    prompts = [c["prompt_ids"] for c in reference["cases"]]
    prompts += [loaded.tokenizer.encode(p) for p in ("Once upon a time,", "def softmax(x):", "In 1969, the first")]
    return [(p, greedy_with_logprobs(3 + (7 * i) % 18)) for i, p in enumerate(prompts)]


def test_smollm2_float32_gives_the_reference_greedy_tokens(f32_runner, smollm2, smollm2_reference):
    cases = smollm2_reference["cases"]
    engine = make_engine(f32_runner, smollm2, "chunked", **SMOLLM2_LIMITS)
    outputs = run_all(engine, [(c["prompt_ids"], SamplingParams(temperature=0, max_tokens=len(c["greedy_ids"])))
                               for c in cases])
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy_ids"] for c in cases]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_equals_solo(smollm2_here, smollm2_reference, request, dtype):
    loaded, runner = (request.getfixturevalue("smollm2"), request.getfixturevalue("f32_runner")) \
        if dtype == "float32" else (request.getfixturevalue("smollm2_bf16"), request.getfixturevalue("bf16_runner"))
    work = requests(loaded, smollm2_reference)
    solo = [run_all(make_engine(runner, loaded, "chunked", **SMOLLM2_LIMITS), [r])[0] for r in work]
    engine = make_engine(runner, loaded, "chunked", **SMOLLM2_LIMITS)
    batched = run_all(engine, work)
    assert engine.num_steps < sum(len(o.outputs[0].token_ids) for o in solo)  # requests did share steps
    if dtype == "float32":
        assert [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids for s in solo]
        assert diverging_requests(batched, solo, max_drift=FLOAT32_MAX_DRIFT) == []
    else:
        diverging_requests(batched, solo, max_drift=BFLOAT16_MAX_DRIFT)  # asserts near-ties only
    assert runner.num_compilations_after_warmup == 0


def test_tensor_parallel_over_the_gpus_matches_one_gpu(f32_runner, smollm2, smollm2_reference):
    runner = gpu_runner(smollm2, tp=3)  # SmolLM2's 9 / 3 heads split at tp 3 only
    work = requests(smollm2, smollm2_reference)
    one = run_all(make_engine(f32_runner, smollm2, "chunked", **SMOLLM2_LIMITS), work)
    split = run_all(make_engine(runner, smollm2, "chunked", **SMOLLM2_LIMITS), work)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in one]
    assert diverging_requests(split, one, max_drift=FLOAT32_MAX_DRIFT) == []
