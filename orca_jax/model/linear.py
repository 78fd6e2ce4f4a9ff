"""How a layer holds its matrix and multiplies by it: its linear method (the shape of vLLM's
QuantizeMethodBase). The decoder is built with a method for each matrix (a `LinearPlan`); the
method makes the layer's parameters in its own layout and computes with them, and is kept as
static data of the layer (part of the compiled program). Nothing changes a layer after it is
built: a model whose matrices change layout (quantized at load, float32 rows for the native
kernel) is a new model (relayout.py).

- FloatLinear: the model's float matrix and XLA's dot; a Dense holds its kernel [in..., out...].
- FloatRowsLinear: a float32 matrix as rows [out, in] for the native CPU kernel, which reads each
  row once on every thread: faster for a decode step's few rows; calls of more rows take XLA's
  dot over the same rows.
- Int8Linear: int8 rows [out, in] with one float32 scale per row (per output channel, symmetric).
  It and GGUFBlockLinear take their inputs as float32 or quantized to int8 (`activations`).
- GGUFBlockLinear: a GGUF tensor's blocks as the file stores them, [out, in / block weights *
  block bytes]; one block type per entry of GGUF_BLOCK_TYPES.

The row methods compute through pallas_kernels.quantized_matmul (the native kernel on CPU, XLA's
dequantize-then-dot elsewhere and for larger calls). An Embed table is rows [N, D] under every
method: a lookup dequantizes the rows it takes, and a tied or separate LM head multiplies by the
table with the same method.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.quantized_matmul import (FLOAT_NATIVE_MAX_TOKENS, NATIVE_MAX_TOKENS, block_weights, dequantize,
                                             quantized_matmul, quantized_matmuls, row_size)

# GGUF tensor types served in place, by their gguf.GGMLQuantizationType name, and the kernel format
# of each (pallas_kernels/quantized_matmul.py). A new block type is one entry here plus its kernel.
GGUF_BLOCK_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q5_0": "q5_0", "Q5_1": "q5_1",
                    "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    """A parameter annotated with logical axis names. Placement happens later, from a rules table,
    so creation never needs a mesh (`eager_sharding=False`)."""
    assert value.ndim == len(axes), (value.shape, axes)
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class LinearMethod:
    """A matrix's layout and matmul. Subclasses are frozen dataclasses: hashable, compared by value."""

    format: str  # the name the quantization report and tests use

    def dense_weights(self, key: jax.Array, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                      axes: tuple[str | None, ...], dtype) -> tuple[nnx.Param, nnx.Param | None]:
        """A Dense's (kernel, scales) in this method's layout, drawn from `key` (random init; the
        values of a checkpoint or file replace them)."""
        raise NotImplementedError

    def table_weights(self, key: jax.Array, num: int, dim: int, axes: tuple[str, str],
                      dtype) -> tuple[nnx.Param, nnx.Param | None]:
        """An Embed's (table of rows [num, ...], scales)."""
        raise NotImplementedError

    def dense(self, x: jax.Array, kernel: jax.Array, scales: jax.Array | None, num_in_axes: int,
              out_shape: tuple[int, ...], num_rows: jax.Array | None) -> jax.Array:
        """x [..., in...] -> [..., out...] in x's dtype. `num_rows`: x's leading rows that are real
        (a native kernel leaves the others zero)."""
        raise NotImplementedError

    def lookup(self, table: jax.Array, scales: jax.Array | None, ids: jax.Array, dtype) -> jax.Array:
        """The table's rows at `ids`, as floats of `dtype`."""
        raise NotImplementedError

    def attend(self, x: jax.Array, table: jax.Array, scales: jax.Array | None,
               num_rows: jax.Array | None) -> jax.Array:
        """x [T, D] times the table's rows [V, D]: [T, V] in x's dtype (the LM head)."""
        raise NotImplementedError


def shared_input_dense(methods: list[LinearMethod], x: jax.Array, kernels: list[jax.Array],
                       scales: list[jax.Array | None], out_shapes: list[tuple[int, ...]],
                       num_rows: jax.Array | None) -> list[jax.Array] | None:
    """x [..., in] times several matrices in one native call (a layer's q, k and v, or gate and up: at
    a decode step's one row, k's and v's own calls cost more than reading their rows), each result
    [..., out...] exactly what its own `dense` gives; None when the methods cannot share a call (not
    all native rows, or taking x differently)."""
    if len(methods) < 2 or not all(isinstance(m, RowsLinear) and m.cpu_native for m in methods):
        return None
    first = methods[0]
    if any((m.activations, m.native_max_tokens) != (first.activations, first.native_max_tokens) for m in methods):
        return None
    ys = quantized_matmuls(x.reshape(-1, x.shape[-1]), tuple(m.format for m in methods), tuple(kernels), tuple(scales),
                           num_rows, cpu_native=True, native_max_tokens=first.native_max_tokens,
                           activations=first.activations)
    return [y.astype(x.dtype).reshape(x.shape[:-1] + out) for y, out in zip(ys, out_shapes)]


# A matrix's path in the decoder ("embed", "lm_head", "layers.3.attn.q", "layers.3.mlp.down") -> its method.
LinearPlan = Callable[[str], LinearMethod]


def within(plan: LinearPlan, prefix: str) -> LinearPlan:
    """The plan of a submodule at `prefix`, which names its matrices from there ("mlp.down")."""
    return lambda name: plan(f"{prefix}.{name}")


@dataclasses.dataclass(frozen=True)
class FloatLinear(LinearMethod):
    """The float matrix and XLA's dot: what every model is built with unless told otherwise."""

    format = "float"

    def dense_weights(self, key, in_shape, out_shape, axes, dtype):
        kernel = jax.random.normal(key, in_shape + out_shape, dtype) / math.sqrt(math.prod(in_shape))
        return param(kernel, axes), None

    def table_weights(self, key, num, dim, axes, dtype):
        return param(jax.random.normal(key, (num, dim), dtype) * 0.02, axes), None

    def dense(self, x, kernel, scales, num_in_axes, out_shape, num_rows):
        return jnp.tensordot(x, kernel, axes=num_in_axes)

    def lookup(self, table, scales, ids, dtype):
        return jnp.take(table, ids, axis=0)

    def attend(self, x, table, scales, num_rows):
        return jnp.einsum("td,vd->tv", x, table)


def all_float(name: str) -> LinearMethod:
    """The plan of a float model: every matrix FloatLinear."""
    return FloatLinear()


class RowsLinear(LinearMethod):
    """A matrix as rows [out, ...] in one of quantized_matmul's formats, multiplied by its kernel:
    natively on CPU (when `cpu_native`) for calls of up to `native_max_tokens` rows, by XLA's
    dequantize-then-dot otherwise."""

    cpu_native: bool
    native_max_tokens: int
    row_dtype: jnp.dtype  # of the rows' elements
    scaled = False  # the rows come with a float32 scale each
    # How the matmul takes x (quantized_matmul's `activations`): float32 rows take it as it is; the
    # quantized methods have a field, "int8" (quantized per row and 32 values) or "float32".
    activations = "float32"

    def fits(self, in_features: int) -> bool:
        """Whether the kernel takes rows of `in_features` weights (whole blocks)."""
        return in_features % block_weights(self.format) == 0

    def _rows(self, out: int, in_features: int, dtype) -> tuple[nnx.Param, nnx.Param | None]:
        # Whole matrices on each device (tensor_parallel_size 1): no logical axes to split them by.
        rows = param(jnp.zeros((out, row_size(self.format, in_features)), self.row_dtype), (None, None))
        return rows, (param(jnp.ones((out,), jnp.float32), (None,)) if self.scaled else None)

    def dense_weights(self, key, in_shape, out_shape, axes, dtype):
        return self._rows(math.prod(out_shape), math.prod(in_shape), dtype)

    def table_weights(self, key, num, dim, axes, dtype):
        return self._rows(num, dim, dtype)

    def matmul(self, x: jax.Array, rows: jax.Array, scales: jax.Array | None, num_rows) -> jax.Array:
        """x [T, in] -> float32 [T, out]."""
        return quantized_matmul(x, self.format, rows, scales, num_rows, cpu_native=self.cpu_native,
                                native_max_tokens=self.native_max_tokens, activations=self.activations)

    def dense(self, x, kernel, scales, num_in_axes, out_shape, num_rows):
        lead = x.shape[:x.ndim - num_in_axes]
        y = self.matmul(x.reshape(-1, math.prod(x.shape[len(lead):])), kernel, scales, num_rows)
        return y.astype(x.dtype).reshape(lead + out_shape)

    def lookup(self, table, scales, ids, dtype):
        rows = jnp.take(table, ids, axis=0)
        return dequantize(self.format, rows, None if scales is None else jnp.take(scales, ids, axis=0)).astype(dtype)

    def attend(self, x, table, scales, num_rows):
        return self.matmul(x, table, scales, num_rows).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class FloatRowsLinear(RowsLinear):
    """A float32 matrix as rows [out, in] for the native kernel, which only a runner on CPU with the
    library loaded chooses (backends.resolve_matmul_impl). XLA's own dot of one row runs on one
    thread near memory speed already; at 2-8 rows the kernel's reading every row once on every thread
    wins (pallas_kernels.quantized_matmul.FLOAT_NATIVE_MAX_TOKENS)."""

    native_max_tokens: int = FLOAT_NATIVE_MAX_TOKENS
    cpu_native: bool = dataclasses.field(default=True, init=False)
    format = "f32"  # the kernel's name for float32 rows
    row_dtype = jnp.float32

    def dense_weights(self, key, in_shape, out_shape, axes, dtype):
        # The float draw, transposed: a random model is the same in either layout.
        kernel, _ = FloatLinear().dense_weights(key, in_shape, out_shape, axes, dtype)
        return param(float_rows(kernel[...], math.prod(in_shape)), (None, None)), None

    def table_weights(self, key, num, dim, axes, dtype):
        return FloatLinear().table_weights(key, num, dim, axes, dtype)  # a table is rows already


def float_rows(kernel: jax.Array, in_features: int) -> jax.Array:
    """A Dense's float kernel [in..., out...] as float32 rows [out, in]."""
    return jnp.asarray(kernel, jnp.float32).reshape(in_features, -1).T


@dataclasses.dataclass(frozen=True)
class Int8Linear(RowsLinear):
    """int8 rows [out, in] and a float32 scale per row: w = scale * q (quantize_int8 makes them)."""

    cpu_native: bool
    native_max_tokens: int = NATIVE_MAX_TOKENS
    activations: str = "float32"
    format = "int8"
    row_dtype = jnp.int8
    scaled = True


@dataclasses.dataclass(frozen=True)
class GGUFBlockLinear(RowsLinear):
    """A GGUF tensor's blocks exactly as the file stores them (uint8 rows), `block_type` a key of
    GGUF_BLOCK_TYPES. `cpu_native` asks for the native kernel on CPU."""

    block_type: str
    cpu_native: bool
    native_max_tokens: int = NATIVE_MAX_TOKENS
    activations: str = "float32"
    row_dtype = jnp.uint8

    def __post_init__(self):
        if self.block_type not in GGUF_BLOCK_TYPES:
            raise ValueError(f"GGUF block type {self.block_type!r} has no kernel; served in place: "
                             f"{', '.join(GGUF_BLOCK_TYPES)}")

    @property
    def format(self) -> str:
        return GGUF_BLOCK_TYPES[self.block_type]


def linear_methods(module: nnx.Module) -> str:
    """`path: method`, one line per layer that has a linear method: what a compiled program of
    `module` assumes of its matrices' layouts beyond their arrays' shapes."""
    return "\n".join(f"{'.'.join(map(str, path))}: {node.method!r}" for path, node in nnx.iter_graph(module)
                     if isinstance(getattr(node, "method", None), LinearMethod))
