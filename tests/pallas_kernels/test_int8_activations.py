"""int8 activations (pallas_kernels/int8_activations.py, cpu/quantized_matmul_int8.cc): every
instruction-set variant, forced one by one, against the numpy reference, bit for bit. The reference
forms the same integer lanes (exact) and replays the same f32 operations, so any wrong nibble, lane,
scale, offset or operation order shows as a difference. A variant this CPU lacks is skipped with the
reason; an AVX2-only Zen 3 runs avx2 and base, a Zen 4 the AVX-512 ones, an Intel Xeon with AMX the
AVX-512 ones (and avxvnni where it has AVX-VNNI)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import native
from pallas_kernels import quantized_matmul as qm
from pallas_kernels.int8_activations import matmul_reference, quantize_reference

from ..conftest import require_native
from .test_quantized_matmul import quantized

ROWS = (1, 2, 5, 16, 64)  # decode, a few sequences, a verify step, a tile's worth, a prefill chunk
FORMATS = qm.INT8_ACTIVATION_FORMATS
int8_matmul = jax.jit(lambda x, format, w, scales: qm.quantized_matmul_native(x, format, w, scales, None, "int8"),
                      static_argnums=1)


@pytest.fixture(params=native.ISAS)
def variant(request):
    """Each variant in turn, restoring the chosen one after."""
    require_native()
    if request.param not in native.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} variant (it has {', '.join(native.supported_isas())})")
    chosen = native.isa()
    native.select_isa(request.param)
    yield request.param
    native.select_isa(chosen)


def random_weights(format: str, out: int, inner: int, rng):
    """Random bytes in the format (every scale, minimum and high bit set somewhere, Q8_0's and int8's
    -128 too)."""
    if format == "int8":
        return rng.integers(-128, 128, (out, inner), dtype=np.int8), rng.standard_normal(out).astype(np.float32)
    return qm.random_blocks(format, out, inner // qm.block_weights(format), rng), None


@pytest.mark.parametrize("format", FORMATS)
def test_every_variant_equals_the_reference_bit_for_bit(variant, format):
    rng = np.random.default_rng(FORMATS.index(format))
    # in = 544, 576, 608: 17, 18, 19 blocks, the last step of 4 blocks (Q6_K's of 2) with 1, 2, 3 real
    # ones, the rest zeros, and the last group of 16 partial; 1536: SmolLM2's widest. K-quants take
    # multiples of 256. 67 outputs: a remainder after every tile and work item.
    widths = (512, 768) if format.endswith("_k") else (544, 576, 608, 1536)
    for inner in widths:
        for source in ("random", "quantized"):
            if source == "random":
                weights, scales = random_weights(format, 67, inner, rng)
            else:
                weights, scales = quantized(format, rng.standard_normal((67, inner)).astype(np.float32))
            for tokens in ROWS:
                x = (rng.standard_normal((tokens, inner)) * rng.uniform(0.1, 10, (tokens, 1))).astype(np.float32)
                want = matmul_reference(x, format, weights, scales)
                got = np.asarray(int8_matmul(x, format, weights, scales))
                np.testing.assert_array_equal(got, want, err_msg=f"{format} {variant} {source} in={inner} T={tokens}")


def test_a_token_gets_the_same_bits_alone_or_in_a_batch(variant):
    """Batch invariance: row t of a 64-row call equals the same row's 1-row call (and a 5-row call's)."""
    rng = np.random.default_rng(7)
    for format in ("q4_1", "q6_k"):
        weights, _ = random_weights(format, 96, 768, rng)
        x = rng.standard_normal((64, 768)).astype(np.float32)
        batched = np.asarray(int8_matmul(x, format, weights, None))
        for t in (0, 5, 63):
            np.testing.assert_array_equal(np.asarray(int8_matmul(x[t:t + 1], format, weights, None))[0], batched[t])
            np.testing.assert_array_equal(np.asarray(int8_matmul(x[t:t + 5], format, weights, None))[0], batched[t])


def test_activations_round_half_to_even_and_a_zero_block_stays_zero(variant):
    """x * (1 / d) lands exactly on .5 here (d = 1 when max |x| = 127): 2.5 -> 2, 3.5 -> 4, -2.5 -> -2;
    an all-zero block has d = 0 and q = 0 (no division by zero)."""
    x = np.zeros((1, 64), np.float32)
    x[0, :4] = [127.0, 2.5, 3.5, -2.5]
    q, d = quantize_reference(x)
    assert d[0].tolist() == [1.0, 0.0] and q[0, 0, :4].tolist() == [127, 2, 4, -2] and not q[0, 1].any()
    weights = np.zeros((1, 64), np.int8)
    weights[0, 1:4] = [1, 10, 100]  # picks q[1], q[2], q[3]: 2 + 40 - 200
    got = np.asarray(int8_matmul(x, "int8", weights, np.ones(1, np.float32)))
    assert got.tolist() == [[2.0 + 40.0 - 200.0]] == matmul_reference(x, "int8", weights, np.ones(1, np.float32)).tolist()


def test_int8_activations_stay_close_to_float32_ones():
    """The method's error, for scale: per 32 values a step of max |x| / 127."""
    rng = np.random.default_rng(3)
    for format in ("q4_1", "q4_k", "q8_0"):
        weights, scales = quantized(format, rng.standard_normal((64, 768)).astype(np.float32))
        x = rng.standard_normal((4, 768)).astype(np.float32)
        exact = qm.quantized_matmul_reference(x, format, weights, scales)
        got = matmul_reference(x, format, weights, scales)
        assert np.abs(got - exact).max() <= 0.02 * np.abs(exact).max(), format


def test_blocks_of_zeros_and_of_values_too_small_to_invert_quantize_to_zeros(variant):
    """A block whose d = max |x| / 127 is zero or below the smallest normal float (1 / d would
    overflow, and 0 * inf is NaN, whose cast to int8 is undefined) is taken as zeros, by the kernel,
    the reference and XLA's path alike; the other blocks of the row are untouched."""
    rng = np.random.default_rng(5)
    weights, scales = quantized("q4_1", rng.standard_normal((40, 128)).astype(np.float32))
    x = rng.standard_normal((2, 128)).astype(np.float32)
    x[0, :32] = 0.0
    x[0, 32:64] = np.float32(1e-38) * rng.standard_normal(32).astype(np.float32)  # d ~ 2e-40, subnormal
    x[0, 32] = 0.0
    q, d = quantize_reference(x)
    assert not q[0, :2].any() and q[0, 2:].any() and q[1].any()
    got = np.asarray(int8_matmul(x, "q4_1", weights, scales))
    want = matmul_reference(x, "q4_1", weights, scales)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(np.asarray(qm.xla_activations(jnp.asarray(x)))[0, :64], np.zeros(64, np.float32))


@pytest.mark.parametrize("format", ["q4_0", "q4_1", "q5_k", "q6_k", "int8"])
def test_xla_path_quantizes_activations_as_the_native_kernel(format):
    """Calls over the native kernel's row cap (and every call on GPU) take XLA's path: the same
    quantized activations (the reference's d * q to rounding: XLA divides by 127 as a multiply by its
    reciprocal), dequantized weights, XLA's summation order."""
    require_native()
    rng = np.random.default_rng(11)
    weights, scales = quantized(format, rng.standard_normal((80, 768)).astype(np.float32))
    x = rng.standard_normal((6, 768)).astype(np.float32)
    q, d = quantize_reference(x)
    np.testing.assert_allclose(np.asarray(qm.xla_activations(jnp.asarray(x))), (q * d[..., None]).reshape(x.shape),
                               rtol=3e-7)
    call = jax.jit(lambda x, w, s, cap: qm.quantized_matmul(x, format, w, s, activations="int8", native_max_tokens=cap),
                   static_argnums=3)
    native_out, xla_out = np.asarray(call(x, weights, scales, 32)), np.asarray(call(x, weights, scales, 0))
    np.testing.assert_array_equal(native_out, matmul_reference(x, format, weights, scales))
    np.testing.assert_allclose(xla_out, native_out, rtol=1e-5, atol=1e-5 * np.abs(native_out).max())


def test_int8_activations_lower_for_cuda_as_dequantize_then_dot():
    require_native()
    shapes = (jax.ShapeDtypeStruct((4, 768), jnp.float32), jax.ShapeDtypeStruct((192, qm.row_size("q4_k", 768)), jnp.uint8))
    program = jax.jit(lambda x, w: qm.quantized_matmul(x, "q4_k", w, activations="int8"))
    module = export.export(program, platforms=["cuda"])(*shapes).mlir_module()
    assert "orca_quantized_matmul" not in module and "stablehlo.dot_general" in module and "round_nearest_even" in module


def test_bad_activation_settings_are_refused_with_the_fix():
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="int8 activations need quantized weights .*'f32' rows take activations='float32'"):
        qm.quantized_matmul(x, "f32", np.zeros((4, 64), np.float32), activations="int8")
    with pytest.raises(ValueError, match="activations must be one of float32, int8, got 'int4'"):
        qm.quantized_matmul(x, "q4_0", np.zeros((4, 36), np.uint8), activations="int4")


def test_a_full_step_of_the_default_token_budget_runs_the_kernel():
    """The native kernel's row cap with int8 activations covers a whole step of the default token
    budget, so every row of a 512-token prompt chunk gets the decode step's arithmetic (the reference's,
    bit for bit), not XLA's rounding: a request's tokens do not depend on what shares its step."""
    require_native()
    from orca_jax.config import SchedulerConfig

    rows = SchedulerConfig().max_num_batched_tokens
    rng = np.random.default_rng(5)
    weights, _ = quantized("q5_0", rng.standard_normal((40, 576)).astype(np.float32))
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    out = jax.jit(lambda x, w: qm.quantized_matmul(x, "q5_0", w, None, activations="int8",
                                                   native_max_tokens=qm.INT8_NATIVE_MAX_TOKENS))(x, weights)
    np.testing.assert_array_equal(np.asarray(out), matmul_reference(x, "q5_0", weights, None))


@pytest.mark.parametrize("format", ["q4_1", "q6_k", "int8"])
def test_nan_and_inf_activations_give_nan_rows_as_the_reference_does(variant, format):
    """A diverged model must look diverged: a NaN or an infinity anywhere in a row makes its block's
    d NaN or infinite, so every output of the row is NaN, in the kernel as in the reference and XLA's
    path (a peak that skipped NaN quantized it to 0 and gave finite numbers). Rows without one are
    untouched. NaN sits at different places in its block: first, in the second vector, last."""
    rng = np.random.default_rng(13)
    weights, scales = random_weights(format, 40, 256, rng)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    x[0, 32] = np.nan
    x[1, 64 + 17] = np.nan
    x[2, 255] = -np.nan
    x[3, 100] = np.inf
    x[4, 5] = -np.inf
    with np.errstate(invalid="ignore"):  # the reference's inf * 0
        want = matmul_reference(x, format, weights, scales)
    assert np.isnan(want[:5]).all() and np.isfinite(want[5]).all()
    got = np.asarray(int8_matmul(x, format, weights, scales))
    np.testing.assert_array_equal(got, want)
    xla = jax.jit(lambda x, w, s: qm.quantized_matmul(x, format, w, s, activations="int8", native_max_tokens=0))
    assert np.isnan(np.asarray(xla(x, weights, scales))[:5]).all()
