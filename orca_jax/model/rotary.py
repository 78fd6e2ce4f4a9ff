"""Rotary position embedding (RoPE), half-split layout (as HF transformers' Llama).

Each head vector is split into halves (x1, x2); pair i = (x1[i], x2[i]) is rotated by the angle
position * inv_freq[i], inv_freq[i] = theta^(-2i / Dh). Checkpoints in llama.cpp's interleaved layout
are converted to this one at import time (see checkpoint/gguf_import.py).

Llama 3.x stretches the low frequencies for a longer context (`Llama3Scaling`): a pair whose
wavelength 2 pi / inv_freq is longer than original_max_position / low_freq_factor tokens turns
`factor` times slower; one shorter than original_max_position / high_freq_factor is kept; in between
the two are blended linearly in original_max_position / wavelength. GGUF files carry the same scaling
precomputed, as one divisor per pair (`FrequencyFactors`, llama.cpp's `rope_freqs` tensor).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from orca_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    factor: float  # dimensionless
    low_freq_factor: float  # dimensionless
    high_freq_factor: float  # dimensionless
    original_max_position: int  # tokens

    def scale(self, inv_freq: Float[Array, " Dh/2"]) -> Float[Array, " Dh/2"]:
        wavelength = 2 * math.pi / inv_freq  # tokens per turn
        # 0 at the long-wavelength edge (fully scaled), 1 at the short one (kept).
        ramp = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blend = jnp.clip(ramp, 0.0, 1.0)
        return (1 - blend) * inv_freq / self.factor + blend * inv_freq


@dataclasses.dataclass(frozen=True)
class FrequencyFactors:
    factors: tuple[float, ...]  # one divisor per rotary pair, dimensionless (a tuple: hashable, static under jit)

    def scale(self, inv_freq: Float[Array, " Dh/2"]) -> Float[Array, " Dh/2"]:
        return inv_freq / jnp.asarray(self.factors, jnp.float32)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    factor: float  # positions are divided by it (HF rope_type "linear", Gemma 3's global layers)

    def scale(self, inv_freq: Float[Array, " Dh/2"]) -> Float[Array, " Dh/2"]:
        return inv_freq / self.factor


RopeScaling = Llama3Scaling | FrequencyFactors | LinearScaling


def rope_scaling_of(config: ModelConfig) -> RopeScaling | None:
    if config.rope_scaling == "llama3":
        return Llama3Scaling(config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                             config.rope_original_max_position)
    if config.rope_scaling == "freq_factors":
        return FrequencyFactors(config.rope_freq_factors)
    if config.rope_scaling == "linear":
        return LinearScaling(config.rope_scaling_factor)
    return None


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Float[Array, " Dh/2"]:
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [Dh/2]
    return inv_freq if scaling is None else scaling.scale(inv_freq)


def apply_rope(
    x: Float[Array, "T N Dh"], positions: Int[Array, " T"], theta: float, scaling: RopeScaling | None = None
) -> Float[Array, "T N Dh"]:
    inv_freq = rope_inv_freq(x.shape[-1], theta, scaling)  # [Dh/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    cos = jnp.cos(angles)[:, None, :]  # [T, 1, Dh/2]
    sin = jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, N, Dh/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
