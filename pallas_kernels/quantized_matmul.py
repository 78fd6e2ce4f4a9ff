"""Matmul with quantized weights: activations f32 [T, in] x weights quantized [out, ...] -> f32 [T, out].

Formats (weights of one output row, `in` a multiple of the format's block, 32 weights unless said):

    q4_0  GGUF Q4_0, 18 bytes a block: f16 d, 16 bytes; byte j = weight j (low nibble) and weight
          j + 16 (high nibble); w = d * (q - 8)
    q4_1  GGUF Q4_1, 20 bytes: f16 d, f16 m, 16 bytes as q4_0; w = d * q + m
    q8_0  GGUF Q8_0, 34 bytes: f16 d, 32 int8; w = d * q
    q5_0  GGUF Q5_0, 22 bytes: f16 d, 4 bytes qh (bit j: weight j's fifth bit, little-endian), 16
          bytes of low nibbles as q4_0; w = d * (q - 16)
    q5_1  GGUF Q5_1, 24 bytes: f16 d, f16 m, qh and nibbles as q5_0; w = d * q + m
    q4_k  GGUF Q4_K, 256 weights in 144 bytes: f16 d, f16 dmin, 12 bytes packing 8 six-bit scales
          and 8 six-bit mins (one pair per 32 weights), 128 bytes of nibbles: each 32 bytes hold
          two sub-blocks (low nibbles the first, high nibbles the second); w = (d * sc) * q - dmin * m
    q5_k  GGUF Q5_K, 256 weights in 176 bytes: d, dmin, scales as q4_k, 32 bytes qh (bit i of byte
          l: the fifth bit of weight l of sub-block i), 128 bytes of nibbles as q4_k; w as q4_k
    q6_k  GGUF Q6_K, 256 weights in 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit highs,
          16 int8 scales (one per 16 weights), f16 d; w = (d * scale) * (q - 32)
    int8  int8 [out, in] with one f32 scale per output row (per-channel, symmetric): w = scale * q
    f32   not quantized: float32 rows [out, in], a float model's matrix transposed. XLA:CPU runs a
          dot of a few rows on one thread; the kernel reads the rows once, on every thread, which
          makes a float model's decode steps of 2-8 rows faster (orca_jax/runner/float_rows.py,
          the float32 rows of orca_jax.model.linear.FloatRowsLinear)

The GGUF formats are the blocks exactly as a GGUF file stores them: `weights` is then the tensor's
uint8 data, [out, in / block weights * block bytes], as `gguf.GGUFReader` maps it.

Implementations behind the one contract (`quantized_matmul`):

- `native`: the C++ kernel (cpu/quantized_matmul.cc) through jax.ffi, in the one native library
  (pallas_kernels.native: built once, AVX-512 / AVX2 / baseline variants chosen at load, forceable).
  It dequantizes each block in registers and accumulates in f32 by fused multiply-adds in an
  order fixed per output element (the .cc file states it), the same for every T and every variant:
  batch-invariant.
  The K-quants' 256-weight super-blocks are taken as eight 32-weight sub-blocks, each with its own
  scale(s) (cpu/quantized_matmul_kquants.inc), in the same order. It knows every format.
  One call may multiply x by several matrices (`quantized_matmuls`: a layer's q, k and v, or gate
  and up), x quantized once and every matrix's rows shared out over the threads together; each
  result is the one its matrix's own call gives.
- `xla`: dequantize to f32, then one dot at HIGHEST precision: what runs on GPU (and on a CPU
  without the native library). Its summation order is XLA's, so it matches the reference to f32
  rounding, not bit for bit.

`quantized_matmul_reference` (numpy) replays the native kernel's arithmetic operation by operation
in f32, so the native kernel must equal it exactly (32 weights at a time, a K-quant super-block's
sub-blocks in order); `dequantize_reference` equals gguf's
own dequantize bit for bit (same f32 operations), which ties the blocks to the file.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Numbered as the .cc file's Format.
FORMATS = ("q4_0", "q4_1", "q8_0", "int8", "f32", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
GGUF_FORMATS = ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
BLOCK = 32  # weights of a block, and the native kernel's unit of summation (two 16-lane halves)
SUPER_BLOCK = 256  # weights of a K-quant block (ggml's QK_K)
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
LANES = 16  # the native kernel's vector width, which fixes its summation order
# Calls of more tokens than this go to XLA's dequantize-then-dot on CPU too: the native kernel reads
# each weight once and wins while the weights' bytes bound a call (decode steps); with many rows XLA's
# float32 GEMM (fused multiply-adds on register tiles) computes faster than the kernel dequantizes and
# multiplies, and the dequantized copy is spread over the rows. Measured twice on shared cores (Intel
# Xeon, 2026-12-01, bench/bench_quantized_matmul.py): native ahead up to 16 rows in both runs, the
# crossover between 32 and 128 rows. On an AVX2-only AMD Zen 3 (2026-12-03, that bench's 30 layers
# of Q4_1 chained in one program) 32 rows took 102 against 345 ms, 64 rows 208 against 425 (in a
# 5-layer program XLA's side was level at 64 rows). 32 = the default max_num_seqs (a test holds them
# together), so every decode step of the default engine runs the native kernel: with 16, the steps of
# 17-32 sequences dequantized every matrix through XLA, and 64 requests at 32 in flight (Q4_1, the
# Zen 3, alternated twice) went 42.9 / 47.8 -> 70.0 / 73.5 tok/s.
NATIVE_MAX_TOKENS = 32
# With int8 activations the native kernel keeps ahead of XLA's path (which dequantizes the weights and
# the activations, then dots) to larger calls: 3 SmolLM2 layers of Q5_0 on a quiet AMD Zen 4
# (2026-12-05, bench/bench_quantized_matmul.py, against XLA's float dot, the faster of its two), once
# the kernel quantized x over the pool: 256 rows 29.4 against 48.9 ms, 512 rows 61.8 against 77.0,
# 1024 rows 135 against 131; its AVX2 variant, Q4_1, 512 rows 81 against XLA's AVX-512 76. So every
# call up to the default token budget per step (SchedulerConfig.max_num_batched_tokens) takes the
# kernel's arithmetic, and a row's result does not depend on its batch up to there (int8 activations
# magnify the f32 rounding that differs between the two paths into steps of the activations'
# quantization). With the cap at 128 rows, 64 requests at 16 in flight (the Q4_K_M file) ran at 124
# tok/s, at 512 at 163.
INT8_NATIVE_MAX_TOKENS = 512
# For f32 rows XLA's own dot is the other side: a 1-row dot runs on one thread near memory speed
# already; at 2-8 rows the kernel's reading every row once on every thread wins (Intel Xeon,
# 2026-12-01, 30 layers of SmolLM2's matrices, 4 x 4 AVX-512 tile: 4 rows 18.7-24.1 against
# 37.0-44.5 ms, 8 rows 23.3-33.3 against 35.6-40.6). At 16 rows it is not settled: AVX-512 was
# 1.16-1.37x ahead, the AVX2 variant 0.87x and 1.08x of XLA in two runs, so 16-row calls stay XLA's.
FLOAT_NATIVE_MAX_TOKENS = 8

# How the matmul takes x: as it is, or quantized to int8 per row and 32-value block (llama.cpp's
# method; int8_activations.py has the arithmetic and its numpy reference). Every format but f32 has it.
ACTIVATIONS = ("float32", "int8")
INT8_ACTIVATION_FORMATS = ("q4_0", "q4_1", "q8_0", "int8", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")

__all__ = ["ACTIVATIONS", "BLOCK", "BLOCK_BYTES", "FLOAT_NATIVE_MAX_TOKENS", "FORMATS", "GGUF_FORMATS",
           "INT8_ACTIVATION_FORMATS", "INT8_NATIVE_MAX_TOKENS", "NATIVE_MAX_TOKENS", "SUPER_BLOCK", "block_weights",
           "check_weights", "dequantize", "dequantize_reference", "quantize_int8", "quantized_matmul",
           "quantized_matmul_native", "quantized_matmul_reference", "quantized_matmul_xla", "quantized_matmuls",
           "quantized_matmuls_native", "random_blocks", "row_size", "xla_activations"]


def block_weights(format: str) -> int:
    """How many weights one block of `format` holds: a row's `in` must be a multiple of it."""
    return SUPER_BLOCK if format.endswith("_k") else BLOCK


def row_size(format: str, in_features: int) -> int:
    """The length of one row of `in_features` weights in `format` (bytes for the GGUF formats)."""
    if format in ("int8", "f32"):
        return in_features
    return in_features // block_weights(format) * BLOCK_BYTES[format]


def check_weights(format: str, weights_shape: tuple[int, ...], in_features: int, scales_shape=None) -> None:
    """Raises ValueError naming the problem when `weights` cannot hold `format` rows of `in_features`."""
    if format not in FORMATS:
        raise ValueError(f"quantized matmul: unknown format {format!r}; known: {', '.join(FORMATS)}")
    if in_features % block_weights(format):
        raise ValueError(f"quantized matmul: in={in_features} is not a multiple of {format}'s "
                         f"{block_weights(format)}-weight block")
    size = row_size(format, in_features)
    if len(weights_shape) != 2 or weights_shape[1] != size:
        raise ValueError(f"quantized matmul: {format} weights for in={in_features} must be [out, {size}], "
                         f"got {tuple(weights_shape)}")
    if format == "int8" and (scales_shape is None or tuple(scales_shape) != (weights_shape[0],)):
        raise ValueError(f"quantized matmul: int8 weights need scales of shape ({weights_shape[0]},), "
                         f"got {scales_shape}")


def check_activations(activations: str, format: str) -> None:
    """Raises ValueError naming the fix for an unknown mode, or int8 activations with f32 rows."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"quantized matmul: activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    if activations == "int8" and format not in INT8_ACTIVATION_FORMATS:
        raise ValueError(f"quantized matmul: int8 activations need quantized weights "
                         f"({', '.join(INT8_ACTIVATION_FORMATS)}); {format!r} rows take activations='float32'")


# ---- Q5_0, Q5_1 and the K-quants: one dequantization for numpy and jnp ----------------------------

# Dequantized by _blocks_shared for both numpy and jnp; Q4_0, Q4_1 and Q8_0 have a twin each.
SHARED_LAYOUT_FORMATS = ("q5_0", "q5_1", "q4_k", "q5_k", "q6_k")


def _int8(xp, bytes_):
    """uint8 -> the int8 they hold, as int32 (two's complement, spelled out: the same in numpy and jnp)."""
    wide = bytes_.astype(xp.int32)
    return wide - 256 * (wide >= 128).astype(xp.int32)


def _bits(xp, bytes_, shifts):
    """bytes [..., n] -> [..., len(shifts), n]: each byte shifted right by each of `shifts`."""
    return bytes_[..., None, :] >> xp.asarray(tuple(shifts), xp.uint8)[:, None]


def _k_scales_mins(xp, packed):
    """Q4_K/Q5_K's 12 bytes -> (8 six-bit scales, 8 six-bit mins): bytes 0-3 hold scales 0-3 (low 6
    bits) and the top bits of scales 4-7; bytes 4-7 the same for the mins; bytes 8-11 the low 4 bits of
    scales 4-7 (low nibble) and of mins 4-7 (high nibble)."""
    sc, mn, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = xp.concatenate([sc & 63, (low & 15) | ((sc >> 2) & 48)], axis=-1)
    mins = xp.concatenate([mn & 63, (low >> 4) | ((mn >> 2) & 48)], axis=-1)
    return scales, mins


def _blocks_shared(format: str, blocks, xp, half):
    """uint8 blocks [..., block bytes] -> f32 weights [..., block weights], with gguf's f32
    operations in gguf's order (so the numpy twin equals gguf.quants.dequantize bit for bit). `xp` is
    numpy or jax.numpy; half(bytes [..., 2k]) reads k little-endian float16 as f32 [..., k]."""
    lead = blocks.shape[:-1]
    f32 = xp.float32
    if format in ("q5_0", "q5_1"):
        head = 2 if format == "q5_0" else 4
        high = (_bits(xp, blocks[..., head:head + 4], range(8)) & 1).swapaxes(-1, -2).reshape(lead + (32,))
        nibbles = blocks[..., head + 4:]
        q = (xp.concatenate([nibbles & 15, nibbles >> 4], axis=-1) | (high << 4)).astype(f32)
        d = half(blocks[..., 0:2])
        return d * (q - f32(16)) if format == "q5_0" else d * q + half(blocks[..., 2:4])
    if format in ("q4_k", "q5_k"):
        d, dmin = half(blocks[..., 0:2]), half(blocks[..., 2:4])
        scales, mins = _k_scales_mins(xp, blocks[..., 4:16])
        nibbles = blocks[..., 16:] if format == "q4_k" else blocks[..., 48:]
        # Each 32 bytes: the low nibbles are one sub-block of 32 weights, the high nibbles the next.
        q = (_bits(xp, nibbles.reshape(lead + (4, 32)), (0, 4)) & 15).reshape(lead + (8, 32))
        if format == "q5_k":  # bit i of qh byte l: the fifth bit of weight l of sub-block i
            q = q | ((_bits(xp, blocks[..., 16:48], range(8)) & 1) << 4)
        w = (d * scales.astype(f32))[..., None] * q.astype(f32) - (dmin * mins.astype(f32))[..., None]
        return w.reshape(lead + (SUPER_BLOCK,))
    if format == "q6_k":
        low = (_bits(xp, blocks[..., 0:128].reshape(lead + (2, 64)), (0, 4)) & 15).reshape(lead + (8, 32))
        high = (_bits(xp, blocks[..., 128:192].reshape(lead + (2, 32)), (0, 2, 4, 6)) & 3).reshape(lead + (8, 32))
        q = ((low | (high << 4)).astype(f32) - f32(32)).reshape(lead + (16, 16))
        scales = half(blocks[..., 208:210]) * _int8(xp, blocks[..., 192:208]).astype(f32)
        return (scales[..., None] * q).reshape(lead + (SUPER_BLOCK,))
    raise ValueError(f"no block layout for {format!r}")


def _half_np(bytes_: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(bytes_).view(np.float16).astype(np.float32)


def _half_jnp(bytes_: jax.Array) -> jax.Array:
    pairs = bytes_.reshape(bytes_.shape[:-1] + (-1, 2))
    return jax.lax.bitcast_convert_type(pairs, jnp.float16).astype(jnp.float32)


# ---- numpy reference ---------------------------------------------------------------------------

def _blocks_reference(format: str, weights: np.ndarray, scales: np.ndarray | None) -> np.ndarray:
    """f32 weights [out, in / 32, 32]; for int8 without the row scale (the kernel applies it last)."""
    out = weights.shape[0]
    if format == "f32":
        return weights.astype(np.float32).reshape(out, -1, BLOCK)
    if format == "int8":
        return weights.view(np.int8).reshape(out, -1, BLOCK).astype(np.float32)
    blocks = weights.reshape(out, -1, BLOCK_BYTES[format])
    if format in SHARED_LAYOUT_FORMATS:
        return _blocks_shared(format, blocks, np, _half_np).reshape(out, -1, BLOCK)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)  # [out, blocks, 1]
    if format == "q8_0":
        return blocks[..., 2:].copy().view(np.int8).astype(np.float32) * d
    packed = blocks[..., 4 if format == "q4_1" else 2:]
    q = np.concatenate([packed & 15, packed >> 4], axis=-1).astype(np.float32)
    if format == "q4_0":
        return (q - np.float32(8)) * d
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    return q * d + m


def dequantize_reference(format: str, weights: np.ndarray, scales: np.ndarray | None = None) -> np.ndarray:
    """The f32 weights [out, in] the blocks stand for."""
    weights = np.asarray(weights)
    w = _blocks_reference(format, weights, scales).reshape(weights.shape[0], -1)
    return w * np.asarray(scales, np.float32)[:, None] if format == "int8" else w


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to f32 (what a fused multiply-add instruction gives), for f32 arrays.
    The product is exact in f64 (24 + 24 bits) and TwoSum gives the f64 sum's exact error, so the
    only case where rounding that sum to f32 differs from rounding the exact value is a sum lying
    exactly halfway between two f32 with a nonzero error: the error's sign then picks the side."""
    product = a.astype(np.float64) * b.astype(np.float64)
    addend = c.astype(np.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)  # total + error == product + addend exactly
    rounded = total.astype(np.float32)
    toward = np.nextafter(rounded, np.where(total > rounded, np.float32(np.inf), np.float32(-np.inf)))
    halfway = (error != 0) & (total != rounded) & (2 * total == rounded.astype(np.float64) + toward)
    # At a tie, the exact value lies past `total` on the error's side: take the neighbour there.
    past_rounded = np.sign(error) == np.sign(total - rounded.astype(np.float64))
    return np.where(halfway & past_rounded, toward, rounded)


def quantized_matmul_reference(x: np.ndarray, format: str, weights: np.ndarray,
                               scales: np.ndarray | None = None, num_rows: int | None = None) -> np.ndarray:
    """out [T, out] computed with the native kernel's f32 operations in its order: per output
    element, 16 lane sums over the blocks in order (acc = fma(x_lo, w_lo, acc), then
    fma(x_hi, w_hi, acc), each rounded once to f32), then a halving tree over the lanes, then the int8
    row scale. Rows of x from `num_rows` on come out zero, as the kernel leaves padding rows."""
    x = np.asarray(x, np.float32)
    weights = np.asarray(weights)
    check_weights(format, weights.shape, x.shape[1], None if scales is None else np.shape(scales))
    w = _blocks_reference(format, weights, scales)  # [O, B, 32]
    xb = x.reshape(x.shape[0], -1, BLOCK)  # [T, B, 32]
    acc = np.zeros((x.shape[0], w.shape[0], LANES), np.float32)
    for b in range(w.shape[1]):
        for half in (slice(0, LANES), slice(LANES, BLOCK)):
            x_half, w_half = np.broadcast_arrays(xb[:, None, b, half], w[None, :, b, half])
            acc = fma_f32(x_half, w_half, acc)
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    out = acc[..., 0]
    out = out * np.asarray(scales, np.float32)[None, :] if format == "int8" else out
    if num_rows is not None:
        out[max(num_rows, 0):] = 0.0
    return out


def random_blocks(format: str, rows: int, blocks: int, rng, scale: float | None = None) -> np.ndarray:
    """GGUF rows [rows, blocks * block bytes] of random bytes with finite f16 d (and m or dmin), for
    tests and benchmarks: scale None draws them normal (every bit of the scales, mins and high bits
    set somewhere, which a quantizer may not do); a float draws them uniform in [0.5, 1.5] * scale
    (small scales keep a chain of layers finite)."""
    size = BLOCK_BYTES[format]
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    draw = rng.standard_normal((rows, blocks, 2)) if scale is None else rng.uniform(0.5, 1.5, (rows, blocks, 2)) * scale
    halves = draw.astype(np.float16).view(np.uint8).reshape(rows, blocks, 4)
    if format == "q6_k":
        data[..., size - 2:] = halves[..., :2]  # d last
    elif format in ("q4_0", "q8_0", "q5_0"):
        data[..., :2] = halves[..., :2]
    else:  # d, then m or dmin
        data[..., :4] = halves
    return data.reshape(rows, -1)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric int8 of f32 weights [out, in]: scale = max |w| / 127 per row (a
    zero row gets scale 1 and zeros), q = round-half-even(w / scale). Returns (q int8, scales f32)."""
    w = np.asarray(w, np.float32)
    peak = np.abs(w).max(axis=1)
    scales = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


# ---- XLA: dequantize, then dot ------------------------------------------------------------------

def dequantize(format: str, weights: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    """jnp twin of dequantize_reference: f32 [rows, in] (also the embedding lookup's rows)."""
    rows = weights.shape[0]
    if format == "f32":
        return weights.astype(jnp.float32)
    if format == "int8":
        return weights.astype(jnp.float32) * scales[:, None].astype(jnp.float32)
    blocks = weights.reshape(rows, -1, BLOCK_BYTES[format])
    if format in SHARED_LAYOUT_FORMATS:
        return _blocks_shared(format, blocks, jnp, _half_jnp).reshape(rows, -1)

    def half(offset):  # [rows, blocks, 1]
        return jax.lax.bitcast_convert_type(blocks[..., offset:offset + 2], jnp.float16).astype(jnp.float32)[..., None]

    if format == "q8_0":
        q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
        return (q * half(0)).reshape(rows, -1)
    packed = blocks[..., 4 if format == "q4_1" else 2:]
    q = jnp.concatenate([packed & 15, packed >> 4], axis=-1).astype(jnp.float32)
    w = (q - 8.0) * half(0) if format == "q4_0" else q * half(0) + half(2)
    return w.reshape(rows, -1)


def xla_activations(x: jax.Array) -> jax.Array:
    """x [T, in] -> f32 d * q [T, in]: int8_activations.quantize_reference's rule in jnp, dequantized
    (per 32-value block d = max |x| / 127, q = round-half-even(x * (1 / d))), for XLA's path."""
    blocks = x.astype(jnp.float32).reshape(x.shape[0], -1, BLOCK)
    d = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True) / jnp.float32(127)
    usable = (d >= jnp.finfo(jnp.float32).tiny) & (d <= jnp.finfo(jnp.float32).max)  # else the block is zeros
    inverse = jnp.where(usable, jnp.float32(1) / jnp.where(usable, d, 1), 0)
    r = jnp.round(blocks * inverse)  # half to even
    q = jnp.clip(jnp.where(jnp.isnan(r), 0, r), -127, 127)
    return (q * d).reshape(x.shape)


def quantized_matmul_xla(x: jax.Array, format: str, weights: jax.Array, scales: jax.Array | None = None) -> jax.Array:
    w = dequantize(format, weights, scales)
    # f32 rows are a float model's own matrices: their dot takes the model's matmul precision (the
    # runner traces under it), as the float model's einsums do; dequantized weights are summed in full.
    precision = None if format == "f32" else jax.lax.Precision.HIGHEST
    return jnp.einsum("ti,oi->to", x.astype(jnp.float32), w, precision=precision)


# ---- native (CPU) ---------------------------------------------------------------------------------

def quantized_matmul_native(x: jax.Array, format: str, weights: jax.Array, scales: jax.Array | None = None,
                            num_rows: jax.Array | int | None = None, activations: str = "float32") -> jax.Array:
    """The C++ kernel; raises NativeUnavailable unless pallas_kernels.native's library is loaded.
    Rows of x from `num_rows` on (a traced or static count; None: all) are skipped and come out zero.
    `activations`: "float32" multiplies x as it is, "int8" quantizes it first (int8_activations.py)."""
    return quantized_matmuls_native(x, (format,), (weights,), (scales,), num_rows, activations)[0]


def quantized_matmuls_native(x: jax.Array, formats: Sequence[str], weights: Sequence[jax.Array],
                             scales: Sequence[jax.Array | None], num_rows: jax.Array | int | None = None,
                             activations: str = "float32") -> list[jax.Array]:
    """x times each of several matrices (formats[i], weights[i], scales[i]) in one call of the C++
    kernel: x is quantized once (int8 activations) and every matrix's rows are shared out over the
    threads together. Each result equals quantized_matmul_native's for its matrix alone, bit for bit."""
    from pallas_kernels import native

    native._require_loaded()
    for format in formats:
        if format not in FORMATS:
            raise ValueError(f"the native kernel has no {format!r} format; it knows {', '.join(FORMATS)}")
        check_activations(activations, format)
    results = [jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32) for w in weights]
    call = jax.ffi.ffi_call(native.MATMUL_TARGET, results)
    pairs = [array for w, s in zip(weights, scales)
             for array in (w, jnp.zeros((0,), jnp.float32) if s is None else s.astype(jnp.float32))]
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32).reshape(())
    return call(x.astype(jnp.float32), rows, *pairs, formats=np.array([FORMATS.index(f) for f in formats], np.int32),
                int8_activations=np.int32(activations == "int8"))


def quantized_matmul(x: jax.Array, format: str, weights: jax.Array, scales: jax.Array | None = None,
                     num_rows: jax.Array | None = None, *, cpu_native: bool = True,
                     native_max_tokens: int = NATIVE_MAX_TOKENS, activations: str = "float32") -> jax.Array:
    """x [T, in] (any float dtype) -> f32 [T, out]. On CPU the native kernel when `cpu_native` (the
    caller checked the library loaded) and T <= native_max_tokens, on every other platform and for
    larger T XLA's dequantize-then-dot: both lowerings are in the program, so one jitted function
    serves CPU and GPU (and lowers for CUDA on a CPU machine). `num_rows`: how many leading rows of x
    are real (a step's tokens before its bucket's padding); the native kernel computes only those and
    gives zeros after them, XLA's dot computes every row. Real rows are the same either way.
    `activations="int8"`: x quantized per row and 32-value block first (int8_activations.py), on
    either path; the native kernel's integer products and XLA's dot of the dequantized x agree to f32
    rounding."""
    return quantized_matmuls(x, (format,), (weights,), (scales,), num_rows, cpu_native=cpu_native,
                             native_max_tokens=native_max_tokens, activations=activations)[0]


@functools.partial(jax.jit, static_argnames=("formats", "cpu_native", "native_max_tokens", "activations"))
def quantized_matmuls(x: jax.Array, formats: tuple[str, ...], weights: tuple[jax.Array, ...],
                      scales: tuple[jax.Array | None, ...], num_rows: jax.Array | None = None, *,
                      cpu_native: bool = True, native_max_tokens: int = NATIVE_MAX_TOKENS,
                      activations: str = "float32") -> list[jax.Array]:
    """`quantized_matmul` of one x by several matrices (a layer's q, k and v): on CPU one native call
    for all of them (quantized_matmuls_native), elsewhere and for larger T one XLA dot each (x
    quantized once). Each result is the one `quantized_matmul` gives for its matrix."""
    for format, w, s in zip(formats, weights, scales, strict=True):
        check_weights(format, w.shape, x.shape[-1], None if s is None else s.shape)
        check_activations(activations, format)
    xla_x = xla_activations(x) if activations == "int8" else x
    xla = lambda: [quantized_matmul_xla(xla_x, *matrix) for matrix in zip(formats, weights, scales)]  # noqa: E731
    if not cpu_native or x.shape[0] > native_max_tokens:
        return xla()
    native_call = lambda: quantized_matmuls_native(x, formats, weights, scales, num_rows, activations)  # noqa: E731
    return jax.lax.platform_dependent(cpu=native_call, default=xla)
