"""bfloat16 KV pages under a float32 model (`kv_cache_dtype="bfloat16"`): the pages hold bf16, a
memory budget holds twice the pages, and the outputs stay close to float32's (batched follows solo
up to bfloat16 rounding: test_batched_equals_solo.py)."""

import jax.numpy as jnp
import pytest

from orca_jax.config import CacheConfig, ConfigError, ParallelConfig, load_model_preset
from orca_jax.parallel.memory_plan import plan_memory

from .conftest import SMOLLM2_LIMITS, make_engine
from .test_engine_bfloat16 import MIN_AGREEMENT, agreement, check_logprob_drift, teacher_forced


def test_bfloat16_pages_double_what_a_budget_holds():
    model = load_model_preset("smollm2-135m-instruct")
    pages = {kv: plan_memory(model, ParallelConfig(), page_size=16, max_model_len=2048, kv_cache_memory=256 << 20,
                             kv_cache_dtype=kv).num_pages for kv in ("auto", "bfloat16")}
    assert pages["bfloat16"] == 2 * pages["auto"]
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8")


def test_smollm2_with_bfloat16_pages_agrees_with_the_float32_reference(smollm2_bf16_kv_runner, smollm2,
                                                                        smollm2_reference):
    k_pages, v_pages = smollm2_bf16_kv_runner.stages[0].kv_cache.layer(0)
    assert k_pages.dtype == v_pages.dtype == jnp.bfloat16
    cases = [(case["prompt_ids"], case["greedy_ids"]) for case in smollm2_reference["cases"]]
    picks = teacher_forced(make_engine(smollm2_bf16_kv_runner, smollm2, "chunked", **SMOLLM2_LIMITS), cases)
    assert agreement(picks, cases) >= MIN_AGREEMENT
    check_logprob_drift(picks, smollm2_reference)
