"""matmul_impl: a float32 model's decode-sized matmuls run in the native kernel over the matrices
transposed to rows ("native", what "auto" picks on CPU), the larger ones in XLA's dot; "xla" keeps
XLA's dot everywhere (the reference). Both give the same tokens, and logprobs equal up to rounding."""

import jax
import numpy as np
import pytest

from orca_jax.config import ConfigError, EngineConfig, ParallelConfig
from orca_jax.engine.step_plan import Buckets, padding_plan
from orca_jax.engine_args import config_from_keywords
from orca_jax.model.backends import resolve_matmul_impl
from orca_jax.runner.model_runner import ModelRunner
from orca_jax.sampling_params import SamplingParams
from pallas_kernels import native

from ..conftest import require_native
from ..engine.conftest import make_engine, run_all

KERNEL_TARGET = "orca_quantized_matmul"
BUCKETS = Buckets(tokens=(1, 2, 4, 8, 16, 64), seqs=(1, 2, 4))
LIMITS = dict(max_num_seqs=4, max_num_batched_tokens=64)


def tiny_runner_with(tiny_trained, matmul_impl):
    settings = config_from_keywords(page_size=4, attention_impl="xla", matmul_impl=matmul_impl)
    runner = ModelRunner(tiny_trained.model, settings, num_pages=64, max_model_len=128, buckets=BUCKETS)
    runner.warm_up(show_progress=False)
    return runner


@pytest.fixture(scope="module")
def native_and_xla(tiny_trained):
    require_native()
    return tiny_runner_with(tiny_trained, "native"), tiny_runner_with(tiny_trained, "xla")


def test_native_matmuls_give_the_xla_tokens_and_logprobs(tiny_trained, native_and_xla):
    native, xla = native_and_xla
    assert (native.matmul_impl, xla.matmul_impl) == ("native", "xla")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    # Prefills of 9-20 tokens (XLA's dot: more than 8 rows) and decodes of 1-3 sequences (the kernel).
    requests = [(list(range(2 + i, 11 + 4 * i)), params) for i in range(3)]
    runs = [run_all(make_engine(runner, tiny_trained, "chunked", **LIMITS), requests) for runner in (native, xla)]
    for a, b in zip(*runs):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        drift = max(abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs))
        assert drift <= 1e-4, drift
    assert native.num_compilations_after_warmup == 0


def test_the_kernel_runs_the_decode_buckets_and_xla_the_larger_ones(native_and_xla):
    native, xla = native_and_xla
    stage = native.stages[0]
    for size in BUCKETS.tokens:
        text = stage.executables["layers", size].as_text()
        assert (KERNEL_TARGET in text) == (size <= 8), size
    assert KERNEL_TARGET not in xla.stages[0].executables["layers", 1].as_text()
    # The tied head's rows are the embedding itself; its calls of up to 8 rows go to the kernel too.
    assert KERNEL_TARGET in stage.executables["head", 4].as_text()


def test_a_steps_padding_rows_are_not_computed(native_and_xla):
    """One token in the 4-token, 4-row bucket: the head's three padding rows point at the real
    token's activations (logits_index 0), so computing them would repeat its logits; the kernel
    skips them instead, leaving zero logits (a uniform distribution: logprob -log V)."""
    runner, _ = native_and_xla
    plan = padding_plan(4, 4, runner.kv_layout, runner.config.vocab_size)
    plan.token_ids[0], plan.segment_ids[0], plan.kv_lens[0], plan.slot_mapping[0] = 5, 0, 1, 0
    plan.num_real_tokens, plan.sampling.num_real_rows = 1, np.int32(1)
    plan.sampling.need_logprobs = np.bool_(True)  # as a request asking for logprobs: the step computes them
    logprob = jax.device_get(runner.run_plan(plan)).logprob
    uniform = -np.log(runner.config.vocab_size)
    np.testing.assert_allclose(logprob[1:], uniform, rtol=1e-6)
    assert abs(logprob[0] - uniform) > 0.1  # the real row has the model's logits


def test_runners_over_one_model_share_the_transposed_rows(tiny_trained, native_and_xla):
    native, _ = native_and_xla
    again = tiny_runner_with(tiny_trained, "auto")
    assert again.matmul_impl == "native"
    first = native.stages[0].params["layers"][0]["mlp"]["down"]["kernel"][...]
    second = again.stages[0].params["layers"][0]["mlp"]["down"]["kernel"][...]
    assert first.shape == (tiny_trained.config.d_model, tiny_trained.config.d_ff)  # [out, in] rows
    assert first.unsafe_buffer_pointer() == second.unsafe_buffer_pointer()  # one copy in memory


def test_native_is_refused_where_it_cannot_run_and_auto_falls_back_to_xla():
    for platform, dtype, tp, named in (("gpu", "float32", 1, "CPU"), ("cpu", "bfloat16", 1, "bfloat16"),
                                       ("cpu", "float32", 2, "tensor_parallel_size=1")):
        with pytest.raises(ConfigError, match=named):
            resolve_matmul_impl("native", platform, dtype, tp)
        assert resolve_matmul_impl("auto", platform, dtype, tp) == "xla"
    assert resolve_matmul_impl("xla", "cpu", "float32", 1) == "xla"
    with pytest.raises(ConfigError, match="tensor_parallel_size=1"):
        EngineConfig(matmul_impl="native", parallel=ParallelConfig(tensor_parallel_size=2))
    with pytest.raises(ConfigError, match="matmul_impl"):
        EngineConfig(matmul_impl="fast")


def test_auto_keeps_xla_where_the_kernel_has_only_its_baseline_variant():
    """The baseline variant (no AVX2) computes the same bits with libm's fma, far slower than XLA."""
    require_native()
    chosen = native.isa()
    try:
        native.select_isa("base")
        assert resolve_matmul_impl("auto", "cpu", "float32", 1) == "xla"
        assert resolve_matmul_impl("native", "cpu", "float32", 1) == "native"
    finally:
        native.select_isa(chosen)
    assert resolve_matmul_impl("auto", "cpu", "float32", 1) == ("xla" if chosen == "base" else "native")
