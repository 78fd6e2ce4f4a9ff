"""A small numpy quantizer for GGUF's Q4_K, Q5_K and Q6_K blocks (gguf-py dequantizes them but has no
quantizer): tests write K-quant blocks with it. It follows ggml's layouts, not its search for the best
scales (plain min/max per sub-block), so what the tests check is the layout: gguf's own dequantize
must read back what was meant, and the error stays under half a step of each sub-block."""

from __future__ import annotations

import numpy as np

SUPER_BLOCK = 256


def _f16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bytes [..., 2], the float32 the file will hold)."""
    half = values.astype(np.float16)
    return half[..., None].view(np.uint8), half.astype(np.float32)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros_like(a), where=b > 0)


def _pack_scales_mins(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [..., 8] -> Q4_K's 12 bytes: scales 0-3 and mins 0-3 in the low 6 bits
    of bytes 0-7, the top 2 bits of scales/mins 4-7 above them, their low 4 bits in bytes 8-11."""
    low, high = scales[..., :4], scales[..., 4:]
    mlow, mhigh = mins[..., :4], mins[..., 4:]
    return np.concatenate([low | ((high >> 4) << 6), mlow | ((mhigh >> 4) << 6), (high & 15) | ((mhigh & 15) << 4)],
                          axis=-1).astype(np.uint8)


def _quantize_with_mins(w: np.ndarray, levels: int):
    """Q4_K/Q5_K's common part for weights [n, 256]: d, dmin bytes, packed scales, q [n, 8, 32]."""
    x = w.reshape(len(w), 8, 32)
    low = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - low) / levels
    d_bytes, d = _f16(step.max(-1) / 63)
    dmin_bytes, dmin = _f16((-low).max(-1) / 63)
    scales = np.clip(np.rint(_ratio(step, d[:, None])), 0, 63).astype(np.uint8)
    mins = np.clip(np.rint(_ratio(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    sub_step = d[:, None] * scales.astype(np.float32)  # what the file's scales give back
    sub_min = dmin[:, None] * mins.astype(np.float32)
    q = np.clip(np.rint(_ratio(x + sub_min[..., None], np.broadcast_to(sub_step[..., None], x.shape))), 0, levels)
    return d_bytes, dmin_bytes, _pack_scales_mins(scales, mins), q.astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] -> 128 bytes: each 32 bytes hold sub-block 2c (low nibbles) and 2c + 1 (high)."""
    return ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(len(q), 128)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_with_mins(w, 15)
    return np.concatenate([d, dmin, scales, _nibbles(q)], axis=-1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _quantize_with_mins(w, 31)
    # qh byte l, bit i: the fifth bit of weight l of sub-block i.
    qh = sum((((q[:, i] >> 4) & 1) << i) for i in range(8)).astype(np.uint8)
    return np.concatenate([d, dmin, scales, qh, _nibbles(q)], axis=-1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.reshape(len(w), 16, 16)
    step = np.abs(x).max(-1) / 31  # per 16 weights; q - 32 in [-32, 31]
    d_bytes, d = _f16(step.max(-1) / 127)
    scales = np.clip(np.rint(_ratio(step, d[:, None])), -128, 127).astype(np.int8)
    sub_step = d[:, None] * scales.astype(np.float32)
    q = (np.clip(np.rint(_ratio(x, np.broadcast_to(sub_step[..., None], x.shape))), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(len(w), 2, 128)  # two halves of 128 weights
    # Low nibbles: byte k of a half's 64 holds weight k (low) and weight 64 + k (high); the 2-bit highs:
    # byte l of a half's 32 holds weights l, 32 + l, 64 + l, 96 + l at bits 0, 2, 4, 6.
    ql = (q[..., :64] & 15) | ((q[..., 64:] & 15) << 4)
    qh = sum(((q[..., 32 * s:32 * s + 32] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(len(w), 128), qh.reshape(len(w), 64), scales.view(np.uint8), d_bytes], axis=-1)


QUANTIZERS = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}


def quantize_k(w: np.ndarray, format: str) -> np.ndarray:
    """f32 weights [rows, in] (in a multiple of 256) -> the GGUF blocks [rows, in / 256 * block bytes]."""
    w = np.asarray(w, np.float32)
    rows, inner = w.shape
    if inner % SUPER_BLOCK:
        raise ValueError(f"{format}: in={inner} is not a multiple of {SUPER_BLOCK}")
    blocks = QUANTIZERS[format](w.reshape(-1, SUPER_BLOCK))
    return np.ascontiguousarray(blocks.reshape(rows, -1))
