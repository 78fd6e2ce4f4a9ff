"""The quantized matmul kernel (pallas_kernels/quantized_matmul.py): every instruction-set variant this
CPU has, forced one by one, against the numpy reference on ragged shapes.

"Exact" here means bit for bit: the reference replays the kernel's f32 operations in the kernel's
order (block dequantization as gguf does it, 16 lane sums of fused multiply-adds over the blocks, a
halving tree over the lanes), so any reordering, unfused or extra fused operation or wrong nibble
shows as a difference. XLA's
dequantize-then-dot (the GPU path, and on CPU calls of more rows than the native kernel takes) sums
in its own order: it is held to a rounding bound instead."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import native
from pallas_kernels import quantized_matmul as qm

from ..conftest import require_native
from .test_native_isa import float_variants
from ..kquants import QUANTIZERS, quantize_k

GGUF_TYPES = {format: gguf.GGMLQuantizationType[format.upper()] for format in qm.GGUF_FORMATS}
# (T, in, out): decode (1-3 tokens), a sequence verifying 4 drafts (5 tokens: a full tile and one
# token), a prefill chunk, a full tile; SmolLM2's in = 576 and 1536; outputs that leave a remainder of rows
# (577 = 4 * 144 + 1, 130) and of items (out not a multiple of 32).
SHAPES = [(1, 576, 192), (2, 1536, 130), (3, 576, 577), (5, 576, 130), (17, 1536, 64), (64, 576, 97)]


def shapes(format: str) -> list[tuple[int, int, int]]:
    """SHAPES, with in = 768 for 576 where the format's blocks are K-quant super-blocks of 256."""
    return [(t, inner if inner % qm.block_weights(format) == 0 else 768, out) for t, inner, out in SHAPES]


def quantized(format: str, w: np.ndarray):
    if format == "f32":
        return w, None
    if format == "int8":
        return qm.quantize_int8(w)
    if format in QUANTIZERS:  # gguf-py has no K-quant quantizer: tests/kquants.py
        return quantize_k(w, format), None
    return gguf.quants.quantize(w, GGUF_TYPES[format]), None


@pytest.fixture
def restore_isa():
    require_native()
    chosen = native.isa()
    yield
    native.select_isa(chosen)


native_matmul = jax.jit(qm.quantized_matmul_native, static_argnums=1)


@pytest.mark.parametrize("format", qm.FORMATS)
def test_every_variant_equals_the_reference_bit_for_bit(restore_isa, format):
    rng = np.random.default_rng(qm.FORMATS.index(format))
    for tokens, inner, out in shapes(format):
        weights, scales = quantized(format, rng.standard_normal((out, inner)).astype(np.float32))
        x = rng.standard_normal((tokens, inner)).astype(np.float32)
        want = qm.quantized_matmul_reference(x, format, weights, scales)
        for isa in float_variants():
            native.select_isa(isa)
            got = np.asarray(native_matmul(x, format, weights, scales))
            np.testing.assert_array_equal(got, want, err_msg=f"{format} {isa} T={tokens} in={inner} out={out}")


@pytest.mark.parametrize("format", qm.GGUF_FORMATS)
def test_every_variant_reads_random_blocks_as_the_reference(restore_isa, format):
    """Blocks of random bytes (every scale, minimum and high bit set somewhere, which a quantizer's
    blocks may not do), one token and a buffered call of several, every variant bit for bit."""
    rng = np.random.default_rng(100 + qm.FORMATS.index(format))
    inner = 1536
    weights = qm.random_blocks(format, 67, inner // qm.block_weights(format), rng)
    for tokens in (1, 3, 9):
        x = rng.standard_normal((tokens, inner)).astype(np.float32)
        want = qm.quantized_matmul_reference(x, format, weights)
        assert np.isfinite(want).all()
        for isa in float_variants():
            native.select_isa(isa)
            got = np.asarray(native_matmul(x, format, weights, None))
            np.testing.assert_array_equal(got, want, err_msg=f"{format} {isa} T={tokens}")


def test_a_token_gets_the_same_bits_alone_or_in_a_batch(restore_isa):
    """Batch invariance: row t of a 64-token call equals the same token's 1-token call."""
    rng = np.random.default_rng(7)
    weights, _ = quantized("q4_1", rng.standard_normal((96, 576)).astype(np.float32))
    x = rng.standard_normal((64, 576)).astype(np.float32)
    batched = np.asarray(native_matmul(x, "q4_1", weights, None))
    for t in (0, 5, 63):
        np.testing.assert_array_equal(np.asarray(native_matmul(x[t:t + 1], "q4_1", weights, None))[0], batched[t])


@pytest.mark.parametrize("format", ["q4_1", "f32"])
def test_rows_past_num_rows_are_skipped_as_padding(restore_isa, format):
    """A step's bucket padding (rows from num_rows on) is not computed: zeros, while the real rows keep
    their bits. The count arrives at run time, so one compiled program serves every count."""
    rng = np.random.default_rng(13)
    weights, scales = quantized(format, rng.standard_normal((130, 576)).astype(np.float32))
    x = rng.standard_normal((8, 576)).astype(np.float32)
    full = qm.quantized_matmul_reference(x, format, weights, scales)
    program = jax.jit(lambda x, w, n: qm.quantized_matmul(x, format, w, None, n))
    for isa in float_variants():
        native.select_isa(isa)
        for rows in (0, 1, 5, 8):
            got = np.asarray(program(x, weights, np.int32(rows)))
            np.testing.assert_array_equal(got[:rows], full[:rows], err_msg=f"{format} {isa} rows={rows}")
            np.testing.assert_array_equal(got[rows:], 0.0, err_msg=f"{format} {isa} rows={rows}")
            np.testing.assert_array_equal(got, qm.quantized_matmul_reference(x, format, weights, scales, rows))


def test_every_decode_step_of_the_default_engine_runs_the_native_kernel(restore_isa):
    """A decode step has one row per running sequence: up to the default max_num_seqs, `quantized_matmul`
    must send it to the native kernel (its bits are the reference's), not to XLA's dequantize-then-dot,
    which on an AVX2 CPU made steps of 17-32 sequences ~1.5x slower under load."""
    from orca_jax.config import SchedulerConfig

    rows = SchedulerConfig().max_num_seqs
    assert qm.NATIVE_MAX_TOKENS >= rows
    rng = np.random.default_rng(19)
    weights, _ = quantized("q4_1", rng.standard_normal((96, 576)).astype(np.float32))
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x, w: qm.quantized_matmul(x, "q4_1", w))(x, weights))
    np.testing.assert_array_equal(got, qm.quantized_matmul_reference(x, "q4_1", weights, None))


def test_the_reference_fma_rounds_once_even_at_a_halfway_f64_sum():
    """4097 * 4097 = 2^24 + 2^13 + 1 lies halfway between two f32; adding +-2^-40 moves the exact
    value off the tie, but the f64 sum rounds back onto it, so rounding that f64 to f32 (ties to
    even) is wrong on one side: the fused result takes the neighbour the exact value is nearer."""
    a = np.array([4097, 4097, 4097], np.float32)
    c = np.array([2.0 ** -40, -2.0 ** -40, 0.0], np.float32)
    np.testing.assert_array_equal(qm.fma_f32(a, a, c), np.array([16785410, 16785408, 16785408], np.float32))


def within_rounding(got: np.ndarray, want: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """Two f32 sums of `in` products in different orders differ by at most ~in * eps * sum |x w|."""
    bound = x.shape[1] * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w).T)
    worst = np.max(np.abs(got - want) / np.maximum(bound, np.finfo(np.float32).tiny))
    assert (np.abs(got - want) <= bound).all(), f"off by up to {worst:.3g} x the rounding bound"


@pytest.mark.parametrize("format", qm.FORMATS)
def test_xla_dequantize_then_dot_is_within_rounding_of_the_reference(format):
    rng = np.random.default_rng(11)
    weights, scales = quantized(format, rng.standard_normal((130, 1536)).astype(np.float32))
    x = rng.standard_normal((5, 1536)).astype(np.float32)
    want = qm.quantized_matmul_reference(x, format, weights, scales)
    got = np.asarray(qm.quantized_matmul(x, format, weights, scales, cpu_native=False))
    within_rounding(got, want, x, qm.dequantize_reference(format, weights, scales))
    np.testing.assert_array_equal(np.asarray(qm.dequantize(format, jnp.asarray(weights),
                                                           None if scales is None else jnp.asarray(scales))),
                                  qm.dequantize_reference(format, weights, scales))


@pytest.mark.parametrize("format", qm.GGUF_FORMATS)
def test_blocks_dequantize_exactly_as_gguf_does(format):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 768)).astype(np.float32)
    w[0] = 0.0  # a zero block (d = 0)
    w[1, :256] = 1e-6  # tiny scales: subnormal f16 d
    w[2, :256] += 3.0  # a block of positive weights only: a zero min
    weights, _ = quantized(format, w)
    want = gguf.quants.dequantize(weights, GGUF_TYPES[format])
    np.testing.assert_array_equal(qm.dequantize_reference(format, weights), want)
    np.testing.assert_array_equal(np.asarray(qm.dequantize(format, jnp.asarray(weights))), want)
    step = np.abs(w).max() / (7 if format in ("q4_0", "q4_1", "q4_k") else 15)
    assert np.abs(want - w).max() <= step, "the blocks do not read back as the weights they were written from"


@pytest.mark.parametrize("format", qm.GGUF_FORMATS)
def test_random_blocks_dequantize_exactly_as_gguf_does(format):
    """Every bit of the scales, mins and high bits set somewhere (a quantizer leaves some at zero):
    random bytes with finite f16 d (and dmin)."""
    weights = qm.random_blocks(format, 16, 3, np.random.default_rng(4))
    want = gguf.quants.dequantize(weights, GGUF_TYPES[format])
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(qm.dequantize_reference(format, weights), want)
    np.testing.assert_array_equal(np.asarray(qm.dequantize(format, jnp.asarray(weights))), want)


@pytest.mark.parametrize("format", ["q4_k", "q5_k", "q6_k"])
def test_k_quants_through_the_entry_point_on_ragged_rows(restore_isa, format):
    """The K-quants through the one entry point, as the engine calls it (native kernel asked for):
    every row count a step sends, the best variant's bits equal to the reference's, and past
    native_max_tokens XLA's dequantize-then-dot within rounding of it."""
    rng = np.random.default_rng(qm.FORMATS.index(format))
    weights, _ = quantized(format, rng.standard_normal((130, 1536)).astype(np.float32))
    w = qm.dequantize_reference(format, weights)
    program = jax.jit(lambda x, w: qm.quantized_matmul(x, format, w, None, cpu_native=True, native_max_tokens=16))
    for rows in (1, 2, 5, 16, 64):
        x = rng.standard_normal((rows, 1536)).astype(np.float32)
        got, want = np.asarray(program(x, weights)), qm.quantized_matmul_reference(x, format, weights)
        if rows <= 16:
            np.testing.assert_array_equal(got, want, err_msg=f"{format} rows={rows}")
        else:
            within_rounding(got, want, x, w)


def test_int8_scales_and_values_match_a_plain_numpy_quantizer():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((48, 64)).astype(np.float32) * rng.uniform(0.01, 3, (48, 1)).astype(np.float32)
    w[3] = 0.0
    q, scales = qm.quantize_int8(w)
    for row in range(w.shape[0]):  # one row at a time, the textbook way
        peak = float(np.max(np.abs(w[row])))
        scale = np.float32(peak / 127) if peak else np.float32(1)
        assert scales[row] == scale, row
        np.testing.assert_array_equal(q[row], np.round(w[row] / scale).astype(np.int8))
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.abs(qm.dequantize_reference("int8", q, scales) - w).max() <= scales.max() / 2 * (1 + 1e-6)


def test_bad_weights_are_refused_with_the_expected_shape():
    x = np.zeros((2, 576), np.float32)
    with pytest.raises(ValueError, match=r"q4_1 weights for in=576 must be \[out, 360\]"):
        qm.quantized_matmul(x, "q4_1", np.zeros((8, 324), np.uint8))
    with pytest.raises(ValueError, match="in=40 is not a multiple of q8_0's 32-weight block"):
        qm.quantized_matmul(np.zeros((2, 40), np.float32), "q8_0", np.zeros((8, 34), np.uint8))
    with pytest.raises(ValueError, match=r"int8 weights need scales of shape \(8,\)"):
        qm.quantized_matmul(x, "int8", np.zeros((8, 576), np.int8))
    with pytest.raises(ValueError, match="unknown format 'q3_k'"):
        qm.quantized_matmul(x, "q3_k", np.zeros((8, 576), np.uint8))
    with pytest.raises(ValueError, match="in=576 is not a multiple of q4_k's 256-weight block"):
        qm.quantized_matmul(x, "q4_k", np.zeros((8, 324), np.uint8))


@pytest.mark.parametrize("format", qm.GGUF_FORMATS)
def test_the_matmul_lowers_for_cuda_as_dequantize_then_dot(format):
    """The GPU path of the same jitted function: exported for CUDA on this CPU machine, with no
    custom call left (the native kernel is a CPU-only branch; tracing it needs the library loaded)."""
    require_native()
    shapes = (jax.ShapeDtypeStruct((4, 768), jnp.float32),
              jax.ShapeDtypeStruct((192, qm.row_size(format, 768)), jnp.uint8))
    exported = export.export(jax.jit(lambda x, w: qm.quantized_matmul(x, format, w)), platforms=["cuda"])(*shapes)
    module = exported.mlir_module()
    assert exported.platforms == ("cuda",)
    assert "orca_quantized_matmul" not in module and "stablehlo.dot_general" in module
