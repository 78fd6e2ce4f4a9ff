"""Building blocks: dense projections with logical axis names, norms, embeddings, MLPs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

if TYPE_CHECKING:
    from orca_jax.model.quantization import Quantized


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter annotated with logical axis names. Placement happens later, from a rules table,
    so creation never needs a mesh (`eager_sharding=False`)."""
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Dense(nnx.Module):
    """y = x . W (+ b), contracting the trailing `in_shape` axes of x with W[in_shape + out_shape].

    Multi-axis shapes keep heads explicit, e.g. the query projection is [D] -> [H, Dh].
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        in_axes: tuple[str | None, ...],
        out_axes: tuple[str | None, ...],
        *,
        use_bias: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        fan_in = math.prod(in_shape)
        kernel = jax.random.normal(rngs.params(), in_shape + out_shape, dtype) / math.sqrt(fan_in)
        self.kernel = param(kernel, in_axes + out_axes)
        self.bias = param(jnp.zeros(out_shape, dtype), out_axes) if use_bias else None
        self.num_in_axes = len(in_shape)
        self.out_shape = out_shape
        # Set by model/quantization.py: `kernel` then holds quantized rows [out, ...], `scales` the
        # int8 format's per-row scales.
        self.quantized: Quantized | None = None
        self.scales: nnx.Param | None = nnx.data(None)

    def __call__(self, x: jax.Array, num_rows: Int[Array, ""] | None = None) -> jax.Array:
        """`num_rows`: x's leading rows that are real (AttentionMetadata.num_tokens); the native
        kernel skips the others, which then hold zeros (before the bias)."""
        if self.quantized is not None:
            rows = x.reshape(-1, math.prod(x.shape[x.ndim - self.num_in_axes:]))
            y = self.quantized.matmul(rows, self.kernel[...], None if self.scales is None else self.scales[...],
                                      num_rows).astype(x.dtype)
            y = y.reshape(x.shape[:x.ndim - self.num_in_axes] + self.out_shape)
        else:
            y = jnp.tensordot(x, self.kernel[...], axes=self.num_in_axes)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.scale = param(jnp.ones((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.scale = param(jnp.ones((dim,), dtype), ("norm",))
        self.bias = param(jnp.zeros((dim,), dtype), ("norm",))
        self.eps = eps

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Embed(nnx.Module):
    """A lookup table [N, D]; `attend` reuses it as a tied LM head."""

    def __init__(self, num: int, dim: int, axes: tuple[str, str], dtype: jnp.dtype, rngs: nnx.Rngs):
        self.embedding = param(jax.random.normal(rngs.params(), (num, dim), dtype) * 0.02, axes)
        self.dtype = dtype
        # As Dense's: `embedding` then holds quantized rows, one per token (the tied head's outputs).
        self.quantized: Quantized | None = None
        self.scales: nnx.Param | None = nnx.data(None)

    def __call__(self, ids: Int[Array, " T"]) -> Float[Array, "T D"]:
        rows = jnp.take(self.embedding[...], ids, axis=0)
        if self.quantized is None:
            return rows
        scales = None if self.scales is None else jnp.take(self.scales[...], ids, axis=0)
        return self.quantized.dequantize(rows, scales).astype(self.dtype)

    def attend(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T V"]:
        if self.quantized is not None:
            scales = None if self.scales is None else self.scales[...]
            return self.quantized.matmul(x, self.embedding[...], scales, num_rows).astype(x.dtype)
        return jnp.einsum("td,vd->tv", x, self.embedding[...])


GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)); with activation "gelu_tanh" it is Gemma's GeGLU."""

    def __init__(self, d_model: int, d_ff: int, dtype: jnp.dtype, rngs: nnx.Rngs, activation: str = "silu"):
        self.activation = activation
        self.gate = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=False, dtype=dtype, rngs=rngs)
        self.up = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=False, dtype=dtype, rngs=rngs)
        self.down = Dense((d_ff,), (d_model,), ("mlp",), ("embed",), use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T D"]:
        gated = GATE_ACTIVATIONS[self.activation](self.gate(x, num_rows)) * self.up(x, num_rows)
        return self.down(gated, num_rows)


class GeluMLP(nnx.Module):
    """GPT-2/3 MLP: down(gelu(up(x))), with biases and the tanh approximation GPT-2 was trained with."""

    def __init__(self, d_model: int, d_ff: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.up = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=True, dtype=dtype, rngs=rngs)
        self.down = Dense((d_ff,), (d_model,), ("mlp",), ("embed",), use_bias=True, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T D"]:
        return self.down(jax.nn.gelu(self.up(x, num_rows), approximate=True), num_rows)
