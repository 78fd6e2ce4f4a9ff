"""A float32 model's matrices as rows for the native kernel (matmul_impl "native"): a runner's stage
rebuilt with linear.FloatRowsLinear for every float matrix the kernel takes (its `in` a whole
number of 32-wide blocks) and for the LM head, each Dense kernel [in..., out...] transposed once
into rows [out, in] on the stage's devices. The LM head's table is already rows and stays as it is.

Runners built over one loaded model (a session's tests, an LLM rebuilt with other limits) share the
rows made from each of its kernel arrays instead of each holding another copy of every matrix.
"""

from __future__ import annotations

import weakref

import jax
from flax import nnx

from orca_jax.model.decoder import Decoder, DecoderStage
from orca_jax.model.layers import Dense
from orca_jax.model.linear import FloatLinear, FloatRowsLinear, float_rows
from orca_jax.model.relayout import abstract_relayout, array_at, filled, matrices

# Rows already made, by the kernel array they came from and their placement; an entry goes with its
# kernel array (weakly held: a memo of a pure function, not a second owner of the model).
_ROWS: dict[tuple[int, object], tuple[weakref.ref, jax.Array]] = {}


def float_rows_methods(model: Decoder) -> dict[str, FloatRowsLinear]:
    """The matrices of `model` the native kernel computes, by path: its float Dense matrices whose
    `in` it takes, and the LM head (the embedding when tied)."""
    head = "embed" if model.lm_head is None else "lm_head"
    rows = FloatRowsLinear()
    return {path: rows for path, module in matrices(model).items()
            if module.method == FloatLinear() and rows.fits(module.rows_shape[1])
            and (isinstance(module, Dense) or path == head)}


def float_rows_stage(model: Decoder, layers: range, *, first: bool, last: bool, state: nnx.State,
                     sharding) -> tuple[nnx.GraphDef, nnx.State]:
    """The pipeline stage of `model` over `layers` with its float matrices as rows: its graph and its
    state, which takes the arrays of `state` (the float stage's, placed or not) and the rows made
    from its kernels, placed with `sharding` (tensor_parallel_size 1: whole on each device)."""
    stage = DecoderStage(abstract_relayout(model, float_rows_methods(model)), layers, first=first, last=last)
    graphdef, abstract = nnx.split(stage)
    before = matrices(DecoderStage(model, layers, first=first, last=last))
    values = nnx.to_pure_dict(state)
    arrays = {f"{path}.kernel": _rows(array_at(values, f"{path}.kernel"), module.rows_shape[1], sharding)
              for path, module in matrices(stage).items()
              if isinstance(module, Dense) and module.method != before[path].method}
    return graphdef, filled(abstract, state, arrays)


def _rows(kernel: jax.Array, in_features: int, sharding) -> jax.Array:
    key = (id(kernel), sharding)
    cached = _ROWS.get(key)
    if cached is not None and cached[0]() is kernel:
        return cached[1]
    rows = jax.device_put(float_rows(kernel, in_features), sharding)
    _ROWS[key] = (weakref.ref(kernel, lambda _, key=key: _ROWS.pop(key, None)), rows)
    return rows
