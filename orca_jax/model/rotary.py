"""Rotary position embedding (RoPE), half-split layout (as HF transformers' Llama).

Each head vector is split into halves (x1, x2); pair i = (x1[i], x2[i]) is rotated by the angle
position * theta^(-2i / Dh). Checkpoints in llama.cpp's interleaved layout are converted to this
one at import time (see checkpoint/gguf_import.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def apply_rope(
    x: Float[Array, "T N Dh"], positions: Int[Array, " T"], theta: float
) -> Float[Array, "T N Dh"]:
    head_dim = x.shape[-1]
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [Dh/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, Dh/2]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, N, Dh/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
