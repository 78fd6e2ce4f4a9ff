"""Which dtype the builder runs a checkpoint in: `auto` keeps the checkpoint's, except bfloat16 /
float16 on CPU, which run in float32 (faster on XLA:CPU, and widening is exact), saying so once."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from orca_jax.checkpoint.store import save_checkpoint
from orca_jax.config import CacheConfig, EngineConfig, SchedulerConfig
from orca_jax.runner.builder import BuildOptions, build_runner, run_dtype

from ..checkpoint.test_store import params_of


@pytest.mark.parametrize("setting, stored, platform, expected", [
    ("auto", "bfloat16", "cpu", "float32"),
    ("auto", "float16", "cpu", "float32"),
    ("auto", "float32", "cpu", "float32"),
    ("auto", "bfloat16", "gpu", "bfloat16"),
    ("auto", "float32", "gpu", "float32"),
    ("bfloat16", "float32", "cpu", "bfloat16"),
    ("float32", "bfloat16", "gpu", "float32"),
])
def test_run_dtype(setting, stored, platform, expected):
    assert run_dtype(setting, stored, platform) == expected


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_trained, tmp_path_factory):
    import dataclasses

    config = dataclasses.replace(tiny_trained.config, dtype="bfloat16")
    params = {k: v.astype(ml_dtypes.bfloat16) for k, v in params_of(tiny_trained.model).items()}
    return save_checkpoint(tmp_path_factory.mktemp("bf16") / "tiny-bf16", config, params)


def runner_for(path, dtype):
    config = EngineConfig(model=str(path), dtype=dtype, max_model_len=32,
                          cache=CacheConfig(page_size=4, kv_cache_memory=1 << 20),
                          scheduler=SchedulerConfig(policy="orca", max_num_seqs=4, max_num_batched_tokens=16))
    runner, loaded, _ = build_runner(config, BuildOptions(token_buckets=[16], seq_buckets=[4]))
    stage = runner.stages[0]
    return loaded, stage.params["layers"][0]["attn"]["q"]["kernel"][...], stage.kv_cache.k[0].dtype


def test_auto_runs_a_bfloat16_checkpoint_in_float32_on_cpu_and_says_so(bf16_checkpoint, capsys):
    loaded, q_kernel, kv_dtype = runner_for(bf16_checkpoint, "auto")
    assert loaded.config.dtype == "float32" and q_kernel.dtype == kv_dtype == jnp.float32
    lines = [line for line in capsys.readouterr().err.splitlines() if "stored in" in line]
    assert lines == ["orca_jax: tiny is stored in bfloat16; running it in float32 on cpu, where bfloat16 is "
                     "slower (--dtype bfloat16 keeps it)"]
    # Widened exactly: the weights the runner holds are the stored bf16 values.
    kernel = np.asarray(q_kernel)
    np.testing.assert_array_equal(kernel, kernel.astype(ml_dtypes.bfloat16).astype(np.float32))
    assert np.abs(kernel).max() > 0


def test_explicit_bfloat16_keeps_the_checkpoint_dtype_silently(bf16_checkpoint, capsys):
    loaded, q_kernel, kv_dtype = runner_for(bf16_checkpoint, "bfloat16")
    assert loaded.config.dtype == "bfloat16" and q_kernel.dtype == kv_dtype == jnp.bfloat16
    assert "stored in" not in capsys.readouterr().err
