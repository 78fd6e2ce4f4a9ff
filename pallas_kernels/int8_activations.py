"""int8 activations for the quantized matmul (llama.cpp's method): each row of x quantized to 8 bits
per 32-value block, multiplied by the weights' integers with integer dot products, scaled in f32.

Quantizing a row, per 32-value block (Q8_0's rule, with rounding half to even):

    d = max |x| / 127 (f32 division);  inv = 1 / d (0 when d is 0);  q = round-half-even(x * inv)

so q is in [-127, 127] and x ~ d * q. The max propagates NaN: a NaN or an infinity in a block makes
its d NaN or infinite (its q 0) and every output of the row NaN, so a diverged model shows as one on
every path (this reference, each native variant, XLA's).

A block's weights are likewise integers and scales: w = s * (q_w - offset) + m, with offset 8 (Q4_0),
16 (Q5_0), 32 (Q6_K), else 0; m Q4_1's and Q5_1's minimum and Q4_K's and Q5_K's -(dmin * min), else
0; s the block's scale (Q6_K: one for weights 0-15, one for 16-31; the K-quants' d * sc; int8 rows:
1, the row scale applied last).

The native kernel (cpu/quantized_matmul_int8.cc) and `matmul_reference` compute one output element
as 16 float lanes over steps of G blocks (blocks Gp .. Gp + G - 1; the block count padded with zero
blocks to a multiple of G). Integer first: every format but Q6_K has one scale per block, so G = 4
and lane 4e + k of step p covers the 8 weights 4k .. 4k + 3 and 16 + 4k .. 16 + 4k + 3 of block
4p + e (its two halves summed as integers before any float step). Q6_K, a scale per half block,
takes G = 2: lane 8h + 4e + k of step p covers weights 16h + 4k .. 16h + 4k + 3 of block 2p + e.

    int_lane = sum over its weights of q_x * (q_w - offset)              (exact: integers)
    acc = fma(float(int_lane), f32(s_lane * d_lane), acc)                (s of the lane's block and half)

steps in order, each operation rounded once to f32. Formats with a minimum sum it apart, per group of
16 blocks (the block count padded with zero blocks to a multiple of 16), lane i of group g taking
block 16g + i:

    min_acc = fma(f32(float(sum of the block's 32 q_x) * d_x), m_block, min_acc)    (groups in order)

and acc = acc + min_acc, lane by lane. Then the halving tree over the 16 lanes (8 + 8, 4 + 4, 2 + 2,
1 + 1) and, for int8 rows, the row scale. Integer sums are exact whatever instructions
form them (AVX-512 VNNI's vpdpbusd, AVX-VNNI's, vpmaddubsw + vpmaddwd on AVX-512 and AVX2, plain ints
on the baseline), so every variant gives these bits, and a row's result depends on its own values
only: batch-invariant.

quantized_matmul.xla_activations is the same quantization in jnp: XLA's path (GPU, and CPU calls over the native
kernel's row cap) multiplies the dequantized activations d * q by the dequantized weights, which
agrees with the native kernel to f32 rounding.
"""

from __future__ import annotations

import numpy as np

from pallas_kernels.quantized_matmul import (BLOCK_BYTES, _half_np as _half, _k_scales_mins, check_activations,
                                             check_weights, fma_f32)

BLOCK = 32
LANES = 16
# q_w's offset per format (w = s * (q_w - offset) + m).
OFFSETS = {"q4_0": 8, "q5_0": 16, "q6_k": 32}
WITH_MINIMUM = ("q4_1", "q5_1", "q4_k", "q5_k")


def quantize_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x f32 [T, in] -> (q int8 [T, in / 32, 32], d f32 [T, in / 32]), the rule above."""
    blocks = np.asarray(x, np.float32).reshape(x.shape[0], -1, BLOCK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    # A block whose d is not a normal finite float (zeros, values so small 1 / d overflows) is zeros.
    usable = (d >= np.finfo(np.float32).tiny) & (d <= np.finfo(np.float32).max)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=usable)
    with np.errstate(invalid="ignore"):
        r = np.rint(blocks * inv[..., None])
    q = np.clip(np.where(np.isnan(r), 0, r), -127, 127).astype(np.int8)
    return q, d


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """16 bytes [..., 16] -> 32 weights: low nibbles are weights 0-15, high nibbles 16-31."""
    return np.concatenate([packed & 15, packed >> 4], axis=-1)


def block_integers(format: str, weights: np.ndarray):
    """A matrix's blocks as (q_w int32 [out, B, 32], s f32 [out, B, 2] (weights 0-15, 16-31),
    m f32 [out, B]), B = in / 32, as the rule above splits them (int8: s = 1, the row scale apart)."""
    out = weights.shape[0]
    if format == "int8":
        q = weights.view(np.int8).reshape(out, -1, BLOCK).astype(np.int32)
        return q, np.ones(q.shape[:2] + (2,), np.float32), np.zeros(q.shape[:2], np.float32)
    blocks = weights.reshape(out, -1, BLOCK_BYTES[format])
    m = None
    if format in ("q4_0", "q4_1", "q8_0", "q5_0", "q5_1"):
        d = _half(blocks[..., 0:2])[..., 0]
        s = np.stack([d, d], axis=-1)
        head = 4 if format in ("q4_1", "q5_1") else 2
        if format in ("q4_1", "q5_1"):
            m = _half(blocks[..., 2:4])[..., 0]
        if format == "q8_0":
            q = blocks[..., 2:].copy().view(np.int8).astype(np.int32)
        elif format in ("q4_0", "q4_1"):
            q = _nibbles(blocks[..., head:]).astype(np.int32)
        else:  # bit j of the 4 bytes qh: weight j's fifth bit
            qh = np.unpackbits(blocks[..., head:head + 4], axis=-1, bitorder="little").astype(np.int32)
            q = _nibbles(blocks[..., head + 4:]).astype(np.int32) | (qh << 4)
        return q, s, np.zeros_like(d) if m is None else m
    lead = blocks.shape[:-1]  # [out, super-blocks]
    if format in ("q4_k", "q5_k"):
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [out, S, 1]
        scales, mins = _k_scales_mins(np, blocks[..., 4:16])
        nibbles = blocks[..., 16:] if format == "q4_k" else blocks[..., 48:]
        q = ((nibbles.reshape(lead + (4, 1, 32)) >> np.array([0, 4], np.uint8)[:, None]) & 15).reshape(lead + (8, 32))
        q = q.astype(np.int32)
        if format == "q5_k":  # bit j of qh byte l: the fifth bit of weight l of sub-block j
            q |= ((blocks[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1).astype(np.int32) << 4
        a = d * scales.astype(np.float32)
        s = np.stack([a, a], axis=-1)
        m = -(dmin * mins.astype(np.float32))
    else:  # q6_k
        low = (blocks[..., 0:128].reshape(lead + (2, 1, 64)) >> np.array([0, 4], np.uint8)[:, None]) & 15
        high = (blocks[..., 128:192].reshape(lead + (2, 1, 32)) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        # sub-block j = 4 * half + 2 * nibble + (bytes 32 on): low is [.., half, nibble, 64] in that order;
        # its fifth and sixth bits: half j // 4 of qh, shifted by 2 (j % 4)
        q = (low.reshape(lead + (8, 32)).astype(np.int32)
             | (high.reshape(lead + (8, 32)).astype(np.int32) << 4))
        scales = _half(blocks[..., 208:210]) * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        s = scales.reshape(lead + (8, 2))
        m = np.zeros(lead + (8,), np.float32)
    return q.reshape(out, -1, BLOCK), s.reshape(out, -1, 2), m.reshape(out, -1)


def step_blocks(format: str) -> int:
    """G, the blocks whose products one step's 16 lanes hold (the rule above)."""
    return 2 if format == "q6_k" else 4


def _lanes(values: np.ndarray, g: int) -> np.ndarray:
    """[..., gS, 32] (S steps) -> [..., S, 16, 64 / g]: the weights of each lane (the rule above)."""
    lead = values.shape[:-2]
    v = values.reshape(lead + (-1, g, 2, 4, 4))  # [..., step, e, h, k, 4]
    if g == 2:  # lane 8h + 4e + k
        return np.swapaxes(v, -4, -3).reshape(lead + (-1, LANES, 4))
    return np.swapaxes(v, -3, -2).reshape(lead + (-1, LANES, 8))  # lane 4e + k, [h, 4] within


def _per_lane(values: np.ndarray, g: int) -> np.ndarray:
    """A value per block and half [..., gS, 2] -> per lane [..., S, 16]."""
    lead = values.shape[:-2]
    if g == 2:
        v = np.swapaxes(values.reshape(lead + (-1, 2, 2)), -1, -2)  # [..., step, h, e]
        return np.repeat(v.reshape(lead + (-1, 4)), 4, axis=-1)
    # equal_nan: a NaN activation makes its block's d NaN, which must reach the output, not fail here
    assert np.array_equal(values[..., 0], values[..., 1], equal_nan=True), "integer first needs one scale per block"
    return np.repeat(values[..., 0].reshape(lead + (-1, 4)), 4, axis=-1)


def matmul_reference(x: np.ndarray, format: str, weights: np.ndarray, scales: np.ndarray | None = None,
                     num_rows: int | None = None) -> np.ndarray:
    """out [T, out]: the native int8-activation kernel's arithmetic replayed (the rule above)."""
    x = np.asarray(x, np.float32)
    weights = np.asarray(weights)
    check_weights(format, weights.shape, x.shape[1], None if scales is None else np.shape(scales))
    check_activations("int8", format)
    qx, dx = quantize_reference(x)
    qw, s, m = block_integers(format, weights)
    qw = qw - OFFSETS.get(format, 0)
    g = step_blocks(format)
    real = qx.shape[1]
    pad = -real % g  # zero blocks up to whole steps
    qx, dx, qw, s, m = (np.concatenate([a, np.zeros_like(a[:, :pad])], axis=1) for a in (qx, dx, qw, s, m))
    ints = np.einsum("tpla,opla->topl", _lanes(qx.astype(np.int64), g), _lanes(qw.astype(np.int64), g))
    dx_lanes = _per_lane(np.repeat(dx[..., None], 2, axis=-1), g)  # [T, S, 16]
    scale = (_per_lane(s, g)[None] * dx_lanes[:, None]).astype(np.float32)  # [T, O, S, 16], rounded once
    acc = np.zeros(ints.shape[:2] + (LANES,), np.float32)
    for p in range(ints.shape[2]):
        acc = fma_f32(ints[:, :, p].astype(np.float32), scale[:, :, p], acc)
    if format in WITH_MINIMUM:
        pad = -qx.shape[1] % LANES  # zero blocks up to whole groups of 16
        block_sums = (qx.astype(np.int64).sum(-1).astype(np.float32) * dx).astype(np.float32)  # [T, B]
        block_sums, m = np.pad(block_sums, ((0, 0), (0, pad))), np.pad(m, ((0, 0), (0, pad)))
        min_acc = np.zeros_like(acc)
        for first in range(0, m.shape[1], LANES):
            group = slice(first, first + LANES)
            x_sum, m_g = np.broadcast_arrays(block_sums[:, None, group], m[None, :, group])
            min_acc = fma_f32(x_sum, m_g, min_acc)
        acc = acc + min_acc
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    out = acc[..., 0]
    if format == "int8":
        out = out * np.asarray(scales, np.float32)[None, :]
    if num_rows is not None:
        out[max(num_rows, 0):] = 0.0
    return out
