"""Shared fixtures: models are loaded once per session, compilations go to a persistent cache."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import pytest

from orca_jax.config import DEFAULT_MODEL, REPO_ROOT

FIXTURES = REPO_ROOT.parent / "shared" / "fixtures"
SMOLLM2 = DEFAULT_MODEL


def _accelerator_platforms() -> list[str]:
    """The GPU platforms jax could start here, judged from the installed plugins and the NVIDIA
    device files without starting a backend: the default platform must be chosen before the first
    backend starts."""
    import glob
    import importlib.metadata
    import importlib.util
    import pkgutil

    names = {entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")}
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins

        names |= {module.name for module in pkgutil.iter_modules(jax_plugins.__path__)}
    has_cuda_plugin = any("cuda" in name for name in names)
    return ["cuda"] if has_cuda_plugin and glob.glob("/dev/nvidia[0-9]*") else []


# CPU first: every test that does not ask for a device runs on the CPU, whatever the machine has
# (the 6-device layouts, the native kernel, messages naming "cpu device(s)"). A GPU stays reachable
# through jax.devices("gpu") for the `gpu` tests.
# An explicit JAX_PLATFORMS wins.
if not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", ",".join(["cpu", *_accelerator_platforms()]))
jax.config.update("jax_compilation_cache_dir", str(REPO_ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
# Six CPU devices (tp 3 x pp 2 for SmolLM2), set before the backend starts; one-device runners use
# the first. On 2 cores they share the cores: the parallel tests check outputs, never speed.
NUM_TEST_DEVICES = 6
jax.config.update("jax_num_cpu_devices", NUM_TEST_DEVICES)


def gpu_devices() -> list:
    """The GPUs jax started, [] on a machine without one."""
    try:
        return jax.devices("gpu")
    except RuntimeError:  # no GPU backend
        return []


# Tiny-model modules that compile an engine or runner in many configurations (draft models, tp x pp
# layouts, every HF family, every matmul backend and bucket set, speculation on and off): together
# about two thirds of the time of the tests that are neither `slow` nor `multiprocess`. `make test`
# runs them; `make test-fast`, the edit loop's subset, leaves them out (`heavy`), as it leaves out
# the Pallas kernels in interpret mode (the native kernel is what runs on a CPU).
# tests/test_suite_platforms.py fails when a name here is no longer a test module.
HEAVY_MODULES = frozenset({
    "test_draft_model_engine", "test_parallel_engine", "test_hf_families", "test_matmul_impl",
    "test_small_buckets", "test_speculative_engine", "test_dummy_weights",
    "test_engine_bfloat16", "test_kquant_serving", "test_program_keys", "test_rejection_sampling",
    "test_speculative_config", "test_speculative_metrics",
})


def pytest_collection_modifyitems(config, items):
    """Markers `make test-fast` selects on, set here so a new test gets them without asking: a test
    that uses a SmolLM2 fixture is `slow`; a test in a module that imports subprocess or
    multiprocessing (CLI runs, servers, multi-host jobs, compilers) is `multiprocess`; a test in one
    of HEAVY_MODULES or running a Pallas kernel in interpret mode is `heavy`. `gpu` tests need a
    GPU: without one they are skipped with the reason (reported as not run, never as passed)."""
    for item in items:
        if any("smollm2" in name for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        module = vars(item.module) if getattr(item, "module", None) else {}
        if "subprocess" in module or "multiprocessing" in module:
            item.add_marker(pytest.mark.multiprocess)
        if module.get("__name__", "").rpartition(".")[2] in HEAVY_MODULES or "pallas-interpret" in item.name:
            item.add_marker(pytest.mark.heavy)
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; this machine has only {jax.default_backend()} devices "
                                   "(on a GPU machine: bench/gpu_run.sh, or python -m pytest -m gpu "
                                   "$(python bench/gpu_check.py --print-gpu-tests))")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def require_native() -> None:
    """Skips when the native kernel cannot be built for want of a compiler; fails when it should
    build and does not (a broken build must not pass as a skip)."""
    import os
    import shutil

    from orca_jax.model.backends import native_unavailable

    reason = native_unavailable()
    if reason is None:
        return
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip(reason)
    pytest.fail(reason)


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    path = FIXTURES / "smollm2_reference.json"
    if not path.is_file():
        # Also committed beside the tests, so a clone without ../shared still runs.
        path = Path(__file__).parent / "fixtures" / "smollm2_reference.json"
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, pulled on first use (the README's test command pulls it first)."""
    from orca_jax.checkpoint.convert import ensure_pulled
    from orca_jax.checkpoint.store import load_model

    ensure_pulled(SMOLLM2, log=lambda message: None)
    return load_model(SMOLLM2)


@pytest.fixture(scope="session")
def tiny_trained():
    from orca_jax.checkpoint.store import load_model

    return load_model(REPO_ROOT / "checkpoints" / "tiny")


@pytest.fixture(scope="session")
def tiny_bf16():
    """The trained tiny model in bfloat16 (weights, activations, KV pages), as on a GPU."""
    from orca_jax.checkpoint.store import load_model

    return load_model(REPO_ROOT / "checkpoints" / "tiny", dtype="bfloat16")


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2):  # after `smollm2`, which pulls the checkpoint on first use
    from orca_jax.checkpoint.store import load_model

    return load_model(SMOLLM2, dtype="bfloat16")


# Runners are compiled once per session and shared by engine and server tests.
def spec_buckets(buckets, proposer):
    """With a proposer, two logit-row buckets only (the largest sequence bucket, and all its
    drafts): fewer programs to compile than the default doublings; small steps pad their rows."""
    if proposer is None:
        return buckets
    return dataclasses.replace(buckets, rows=(buckets.seqs[-1], buckets.seqs[-1] * (1 + proposer.num_speculative_tokens)))


def warm_tiny_runner(tiny_trained, attention_impl, tp=1, pp=1, proposer=None, num_pages=160):
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner.model_runner import ModelRunner
    from orca_jax.engine.step_plan import Buckets

    buckets = Buckets(tokens=(16, 64), seqs=(4, 8))
    settings = config_from_keywords(page_size=4, attention_impl=attention_impl, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp)
    runner = ModelRunner(tiny_trained.model, settings, num_pages=num_pages, max_model_len=128,
                         buckets=spec_buckets(buckets, proposer), proposer=proposer)
    runner.warm_up(show_progress=False)
    return runner


def warm_smollm2_runner(smollm2, tp=1, pp=1, kv_cache_dtype="auto", attention_impl="auto", proposer=None,
                        token_buckets=(32, 128)):
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner.model_runner import ModelRunner
    from orca_jax.engine.step_plan import Buckets

    # "auto": what users get (the native kernel on CPU when it builds), so the reference and
    # batch-invariance tests on the real model cover it, alone and per shard under tp.
    buckets = Buckets(tokens=token_buckets, seqs=(8,))
    settings = config_from_keywords(page_size=16, attention_impl=attention_impl, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(smollm2.model, settings, num_pages=96, max_model_len=2048,
                         buckets=spec_buckets(buckets, proposer), proposer=proposer)
    runner.warm_up(show_progress=False)
    return runner


@pytest.fixture(scope="session")
def tiny_runner(tiny_trained):
    return warm_tiny_runner(tiny_trained, "xla")


# Speculative decoding's runners: n-gram drafts of up to SPEC_TOKENS, proposed on the device, with
# the default lookup lengths (what users get).
SPEC_TOKENS = 4


def spec_proposer():
    from orca_jax.config import SpeculativeConfig
    from orca_jax.runner.speculation import NgramProposer

    return NgramProposer.from_config(SpeculativeConfig(num_speculative_tokens=SPEC_TOKENS))


@pytest.fixture(scope="session")
def tiny_spec_runner(tiny_trained):
    return warm_tiny_runner(tiny_trained, "xla", proposer=spec_proposer())


@pytest.fixture(scope="session")
def tiny_spec_pp2_runner(tiny_trained):
    return warm_tiny_runner(tiny_trained, "xla", pp=2, proposer=spec_proposer())


@pytest.fixture(scope="session")
def smollm2_spec_runner(smollm2):
    return warm_smollm2_runner(smollm2, proposer=spec_proposer())


# Draft-model speculation: the target drafting for itself (greedy drafts all pass: a check that the
# draft's own KV pages stay right), and a draft that differs from the target in its weights and its
# temperature (drafts pass and fail, greedy or sampled).
def draft_proposer(name, loaded):
    from orca_jax.runner.speculation import DraftModelProposer

    return DraftModelProposer(SPEC_TOKENS, name, loaded.config, loaded.model)


def perturbed_model(model, noise=0.3, logit_scale=0.5, seed=1):
    """`model` with Gaussian noise (`noise` x each matrix's std) on its matrices and its final norm
    scaled by `logit_scale`, which scales its logits: a temperature mismatch."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + noise * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype) if x.ndim >= 2 else x
              for x, k in zip(leaves, keys)]
    perturbed = nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))
    perturbed.final_norm.scale[...] = perturbed.final_norm.scale[...] * logit_scale
    return perturbed


@pytest.fixture(scope="session")
def tiny_noisy_draft(tiny_trained):
    import dataclasses

    return dataclasses.replace(tiny_trained, model=perturbed_model(tiny_trained.model))


@pytest.fixture(scope="session")
def tiny_self_draft_runner(tiny_trained):
    return warm_tiny_runner(tiny_trained, "xla", proposer=draft_proposer("tiny", tiny_trained))


@pytest.fixture(scope="session")
def tiny_noisy_draft_runner(tiny_trained, tiny_noisy_draft):
    return warm_tiny_runner(tiny_trained, "xla", proposer=draft_proposer("noisy tiny", tiny_noisy_draft))


@pytest.fixture(scope="session")
def tiny_noisy_draft_pp2_runner(tiny_trained, tiny_noisy_draft):
    return warm_tiny_runner(tiny_trained, "xla", pp=2, proposer=draft_proposer("noisy tiny", tiny_noisy_draft))


@pytest.fixture(scope="session")
def smollm2_self_draft_runner(smollm2):
    return warm_smollm2_runner(smollm2, proposer=draft_proposer("smollm2-135m-instruct", smollm2))


@pytest.fixture(scope="session")
def tiny_pallas_runner(tiny_trained):
    """The same runner with the Pallas kernel, run in interpret mode (what "pallas" is on CPU)."""
    return warm_tiny_runner(tiny_trained, "pallas")


@pytest.fixture(scope="session")
def tiny_native_runner(tiny_trained):
    """The same runner with the native C++ kernel."""
    require_native()
    return warm_tiny_runner(tiny_trained, "native")


@pytest.fixture(scope="session")
def smollm2_runner(smollm2):
    return warm_smollm2_runner(smollm2)


@pytest.fixture(scope="session")
def tiny_bf16_runner(tiny_bf16):
    return warm_tiny_runner(tiny_bf16, "xla")


@pytest.fixture(scope="session")
def smollm2_bf16_runner(smollm2_bf16):
    return warm_smollm2_runner(smollm2_bf16)


@pytest.fixture(scope="session")
def smollm2_bf16_kv_runner(smollm2):
    """float32 weights and activations, bfloat16 KV pages."""
    return warm_smollm2_runner(smollm2, kv_cache_dtype="bfloat16")


@pytest.fixture(scope="session")
def smollm2_tp3_runner(smollm2):
    """SmolLM2 over 3 devices (its 9 query / 3 KV heads split 3 ways); shared by the engine and
    server tests of tensor parallelism."""
    return warm_smollm2_runner(smollm2, tp=3)


def quantized_smollm2(smollm2, quantization):
    import dataclasses

    from orca_jax.model.quantization import quantize_decoder

    model, _ = quantize_decoder(smollm2.model, quantization, smollm2.path)
    return dataclasses.replace(smollm2, model=model)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2):
    """SmolLM2 serving its GGUF's own blocks (Q4_1 projections, Q8_0 embedding and tied head), with
    int8 activations (the engine's default)."""
    return quantized_smollm2(smollm2, "gguf")


@pytest.fixture(scope="session")
def smollm2_int8(smollm2):
    """SmolLM2's float32 weights quantized to int8 per output channel (float32 activations, the
    engine's default for int8 weights)."""
    return quantized_smollm2(smollm2, "int8")


@pytest.fixture(scope="session")
def smollm2_gguf_runner(smollm2_gguf):
    # A 16-token bucket for decode steps and a 128-token one for prefills: with int8 activations (the
    # default for gguf) both run the native kernel (quantized_matmul.INT8_NATIVE_MAX_TOKENS).
    return warm_smollm2_runner(smollm2_gguf, token_buckets=(16, 128))


@pytest.fixture(scope="session")
def smollm2_int8_runner(smollm2_int8):
    return warm_smollm2_runner(smollm2_int8, token_buckets=(16, 128))


# ---- on a GPU (`gpu` tests: skipped where there is none, before these fixtures are reached) ----

def warm_gpu_runner(loaded, tp=1, token_buckets=(32, 128), seq_buckets=(8,), num_pages=96, max_model_len=2048,
                    weights=None):
    """`loaded`'s runner on the first `tp` GPUs (skips where there are fewer): Pallas attention, page
    size 16, the engine's matmul precision for the model's dtype (a float32 model's: "highest", no
    TF32; a bfloat16 one's: "default")."""
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner.model_runner import ModelRunner

    devices = gpu_devices()
    if len(devices) < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs, this machine has {len(devices)}")
    runner = ModelRunner(loaded.model, config_from_keywords(page_size=16, tensor_parallel_size=tp), num_pages=num_pages,
                         max_model_len=max_model_len, buckets=Buckets(tokens=token_buckets, seqs=seq_buckets),
                         devices=devices[:tp], weights=weights)
    runner.warm_up(show_progress=False)
    return runner


@pytest.fixture(scope="session")
def tiny_gpu_runner(tiny_trained):
    """The committed tiny model (needs no download) on the GPU."""
    runner = warm_gpu_runner(tiny_trained, token_buckets=(16, 64), seq_buckets=(4, 8), max_model_len=128)
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    return runner


@pytest.fixture(scope="session")
def llama3_8b_dummy():
    """Nothing carried: Llama-3-8B's shapes (GQA 32:8 x 128, d 4096, d_ff 14336, 128256 tokens) at 2
    of its 32 layers in float32, as a loaded model without weights or tokenizer: its runner makes
    seeded random weights on the GPU (`--load-format dummy`, scaled so the top token leads by far
    more than rounding)."""
    from types import SimpleNamespace

    from orca_jax.config import load_model_preset
    from orca_jax.model.decoder import abstract_decoder

    config = dataclasses.replace(load_model_preset("llama-3-8b"), n_layers=2, dtype="float32")
    return SimpleNamespace(path=config.name, config=config, model=abstract_decoder(config), tokenizer=None)


@pytest.fixture(scope="session")
def llama3_8b_dummy_gpu_runner(llama3_8b_dummy):
    from orca_jax.checkpoint.dummy import DummyWeights

    runner = warm_gpu_runner(llama3_8b_dummy, token_buckets=(16, 128), num_pages=64, max_model_len=256,
                             weights=DummyWeights(seed=0))
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    return runner


@pytest.fixture(scope="session")
def smollm2_here():
    """SmolLM2 cannot travel to the GPU machine lent for a run: say so instead of trying to pull it."""
    if not (REPO_ROOT / "checkpoints" / SMOLLM2 / "model.toml").is_file():
        pytest.skip(f"checkpoints/{SMOLLM2} is not on this machine: a lent GPU machine has no network to pull it "
                    "and takes at most 64 MiB along (the converted checkpoint is 337 MB); where it can be "
                    f"copied or pulled (`orca-jax pull {SMOLLM2}`), these tests run")


@pytest.fixture(scope="session")
def smollm2_gpu_runner(smollm2_here, smollm2):
    runner = warm_gpu_runner(smollm2)
    assert runner.attention_impl == "pallas" and runner.matmul_precision == "highest"
    return runner
