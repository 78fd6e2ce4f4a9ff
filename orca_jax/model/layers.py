"""Building blocks: dense projections with logical axis names, norms, embeddings, MLPs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from orca_jax.model.linear import FloatLinear, LinearMethod, LinearPlan, all_float, param, shared_input_dense


class Dense(nnx.Module):
    """y = x . W (+ b), contracting the trailing `in_shape` axes of x with W (in_shape -> out_shape).

    Multi-axis shapes keep heads explicit, e.g. the query projection is [D] -> [H, Dh]. `method`
    (linear.py) holds W in its layout (`kernel`, and `scales` for int8) and multiplies by it.
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
        method: LinearMethod = FloatLinear(),
    ):
        self.method = method
        self.kernel, self.scales = method.dense_weights(rngs.params(), in_shape, out_shape, in_axes + out_axes, dtype)
        self.bias = param(jnp.zeros(out_shape, dtype), out_axes) if use_bias else None
        self.num_in_axes = len(in_shape)
        self.out_shape = out_shape
        self.rows_shape = (math.prod(out_shape), math.prod(in_shape))  # (out, in) of the matrix as rows

    def __call__(self, x: jax.Array, num_rows: Int[Array, ""] | None = None) -> jax.Array:
        """`num_rows`: x's leading rows that are real (AttentionMetadata.num_tokens); a native
        kernel skips the others, which then hold zeros (before the bias)."""
        return self.biased(self.method.dense(x, self.kernel[...], None if self.scales is None else self.scales[...],
                                             self.num_in_axes, self.out_shape, num_rows))

    def biased(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...]


def dense_all(denses: list[Dense], x: jax.Array, num_rows: Int[Array, ""] | None = None) -> list[jax.Array]:
    """[d(x, num_rows) for d in denses], in one native call where their methods allow it
    (linear.shared_input_dense) and each contracts x's last axis alone (q, k, v; gate, up)."""
    shared = None
    if all(d.num_in_axes == 1 for d in denses):
        shared = shared_input_dense([d.method for d in denses], x, [d.kernel[...] for d in denses],
                                    [None if d.scales is None else d.scales[...] for d in denses],
                                    [d.out_shape for d in denses], num_rows)
    if shared is None:
        return [d(x, num_rows) for d in denses]
    return [d.biased(y) for d, y in zip(denses, shared)]


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
    """A lookup table of rows [N, ...] (`embedding`, and `scales` for int8) in `method`'s layout;
    `attend` reuses it as a tied LM head (a row per output token)."""

    def __init__(self, num: int, dim: int, axes: tuple[str, str], dtype: jnp.dtype, rngs: nnx.Rngs,
                 method: LinearMethod = FloatLinear()):
        self.method = method
        self.embedding, self.scales = method.table_weights(rngs.params(), num, dim, axes, dtype)
        self.dtype = dtype
        self.rows_shape = (num, dim)  # (out, in) of the matrix as rows (as a head)

    def __call__(self, ids: Int[Array, " T"]) -> Float[Array, "T D"]:
        return self.method.lookup(self.embedding[...], self._scales(), ids, self.dtype)

    def attend(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T V"]:
        return self.method.attend(x, self.embedding[...], self._scales(), num_rows)

    def _scales(self) -> jax.Array | None:
        return None if self.scales is None else self.scales[...]


GATE_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class SwiGLU(nnx.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)); with activation "gelu_tanh" it is Gemma's GeGLU.
    `linear` names each matrix's method ("gate", "up", "down")."""

    def __init__(self, d_model: int, d_ff: int, dtype: jnp.dtype, rngs: nnx.Rngs, activation: str = "silu",
                 linear: LinearPlan = all_float):
        self.activation = activation
        self.gate = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=False, dtype=dtype, rngs=rngs,
                          method=linear("gate"))
        self.up = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=False, dtype=dtype, rngs=rngs,
                        method=linear("up"))
        self.down = Dense((d_ff,), (d_model,), ("mlp",), ("embed",), use_bias=False, dtype=dtype, rngs=rngs,
                          method=linear("down"))

    def __call__(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T D"]:
        gate, up = dense_all([self.gate, self.up], x, num_rows)
        gated = GATE_ACTIVATIONS[self.activation](gate) * up
        return self.down(gated, num_rows)


class GeluMLP(nnx.Module):
    """GPT-2/3 MLP: down(gelu(up(x))), with biases and the tanh approximation GPT-2 was trained with."""

    def __init__(self, d_model: int, d_ff: int, dtype: jnp.dtype, rngs: nnx.Rngs, linear: LinearPlan = all_float):
        self.up = Dense((d_model,), (d_ff,), ("embed",), ("mlp",), use_bias=True, dtype=dtype, rngs=rngs,
                        method=linear("up"))
        self.down = Dense((d_ff,), (d_model,), ("mlp",), ("embed",), use_bias=True, dtype=dtype, rngs=rngs,
                          method=linear("down"))

    def __call__(self, x: Float[Array, "T D"], num_rows: Int[Array, ""] | None = None) -> Float[Array, "T D"]:
        return self.down(jax.nn.gelu(self.up(x, num_rows), approximate=True), num_rows)
