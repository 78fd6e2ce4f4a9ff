"""Rotary position embedding (RoPE), half-split layout (as HF transformers' Llama).

Each head vector is split into halves (x1, x2); pair i = (x1[i], x2[i]) is rotated by the angle
position * inv_freq[i], inv_freq[i] = theta^(-2i / Dh). Checkpoints in llama.cpp's interleaved layout
are converted to this one at import time (see checkpoint/gguf_import.py).

Llama 3.x stretches the low frequencies for a longer context (`Llama3Scaling`): a pair whose
wavelength 2 pi / inv_freq is longer than original_max_position / low_freq_factor tokens turns
`factor` times slower; one shorter than original_max_position / high_freq_factor is kept; in between
the two are blended linearly in original_max_position / wavelength. GGUF files carry the same scaling
precomputed, as one divisor per pair (`FrequencyFactors`, llama.cpp's `rope_freqs` tensor).

The engine computes each step's cos and sin on the host, once for all layers (`HostRotations`, into
`Rotations`): inside the compiled program XLA:CPU evaluated them again in every layer's q and k
fusion, per head (1.5 ms of a 31 ms 16-sequence decode step of SmolLM2, AMD EPYC Zen 4), and copied
a once-computed table back into each consumer. Calls without them (full-sequence forward passes,
the draft model's proposals) compute cos and sin from the positions in the program.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
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


@dataclasses.dataclass(frozen=True)
class Rotary:
    """What fixes a layer's rotary angles: its head dim, base and frequency scaling."""

    head_dim: int
    theta: float
    scaling: RopeScaling | None = None


def layer_rotary(config: ModelConfig, index: int) -> Rotary | None:
    """Layer `index`'s rotary kind; None where positions come from a learned embedding (GPT-2)."""
    if config.architecture != "llama":
        return None
    # Gemma 3's sliding layers rotate with their own base and no scaling; every other layer with the
    # model's.
    if config.layer_window(index) is not None and config.rope_local_theta is not None:
        return Rotary(config.head_dim, config.rope_local_theta)
    return Rotary(config.head_dim, config.rope_theta, rope_scaling_of(config))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Float[Array, " Dh/2"]:
    inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)  # [Dh/2]
    return inv_freq if scaling is None else scaling.scale(inv_freq)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rotations:
    """cos and sin of every token's angles, for each rotary kind of the model (`kinds`, static)."""

    cos: Float[Array, "R T Dh/2"]
    sin: Float[Array, "R T Dh/2"]
    kinds: tuple[Rotary, ...] = dataclasses.field(metadata=dict(static=True))

    def of(self, kind: Rotary) -> tuple[Float[Array, "T Dh/2"], Float[Array, "T Dh/2"]] | None:
        """`kind`'s cos and sin; None when computed for other kinds (a draft model's layers)."""
        if kind not in self.kinds:
            return None
        i = self.kinds.index(kind)
        return self.cos[i], self.sin[i]


class HostRotations:
    """A model's rotary kinds with their frequencies in numpy: a step's `Rotations` from its positions."""

    def __init__(self, config: ModelConfig):
        kinds = [layer_rotary(config, i) for i in range(config.n_layers)]
        self.kinds = tuple(dict.fromkeys(kind for kind in kinds if kind is not None))
        self.inv_freq = np.stack([np.asarray(rope_inv_freq(k.head_dim, k.theta, k.scaling)) for k in self.kinds]) \
            if self.kinds else None  # [R, Dh/2]

    def __call__(self, positions: np.ndarray) -> Rotations | None:
        if not self.kinds:
            return None
        # The angles as the program computes them (a float32 product); numpy's float32 cos and sin are
        # within 1 ulp of float64's rounded, at a tenth of their time (18 us for 512 tokens).
        angles = positions.astype(np.float32)[None, :, None] * self.inv_freq[:, None, :]  # [R, T, Dh/2]
        return Rotations(np.cos(angles), np.sin(angles), self.kinds)


def rotation_tables(
    kind: Rotary, positions: Int[Array, " T"], rotations: Rotations | None = None
) -> tuple[Float[Array, "T Dh/2"], Float[Array, "T Dh/2"]]:
    """cos and sin of `kind`'s angles at `positions`: the step's host-computed ones where given."""
    tables = None if rotations is None else rotations.of(kind)
    if tables is not None:
        return tables
    inv_freq = rope_inv_freq(kind.head_dim, kind.theta, kind.scaling)  # [Dh/2]
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, Dh/2]
    return jnp.cos(angles), jnp.sin(angles)


def rotate(
    x: Float[Array, "T N Dh"], cos: Float[Array, "T Dh/2"], sin: Float[Array, "T Dh/2"]
) -> Float[Array, "T N Dh"]:
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, Dh/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)  # [T, N, Dh/2] each
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def apply_rope(
    x: Float[Array, "T N Dh"], positions: Int[Array, " T"], theta: float, scaling: RopeScaling | None = None
) -> Float[Array, "T N Dh"]:
    return rotate(x, *rotation_tables(Rotary(x.shape[-1], theta, scaling), positions))
