"""Mesh construction and placement by logical axis names.

Model parameters carry logical axis names (`orca_jax.model.LOGICAL_AXES`); `LOGICAL_AXIS_RULES` is
the one table that maps them to mesh axes. Tensor parallelism splits heads and the MLP width over
'tp' (Megatron style); with one device every rule resolves to a replicated placement, so a larger
mesh changes this table and the mesh shape, not the model.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orca_jax.config import ParallelConfig

MESH_AXES = ("pp", "tp")

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": None,
    "embed": None,
    "positions": None,
    "q_heads": "tp",
    "kv_heads": "tp",
    "head_dim": None,
    "mlp": "tp",
    "norm": None,
}


def make_mesh(parallel: ParallelConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    needed = parallel.pipeline_parallel_size * parallel.tensor_parallel_size
    if needed > len(devices):
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {needed} devices, but only {len(devices)} "
            f"are visible ({jax.default_backend()})"
        )
    grid = np.array(devices[:needed]).reshape(parallel.pipeline_parallel_size, parallel.tensor_parallel_size)
    # Mesh(...) gives Auto axes on every jax version (jax.make_mesh defaults to Explicit in 0.10).
    return Mesh(grid, MESH_AXES)


def logical_to_spec(axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(None if a is None else LOGICAL_AXIS_RULES[a] for a in axes))


def param_shardings(state: nnx.State, mesh: Mesh):
    """A NamedSharding per parameter, from its logical axis names."""
    specs = nnx.get_partition_spec(state)
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_spec(tuple(spec))),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """KV pages [P, page, K, Dh]: KV heads split like the K/V projections that produce them."""
    return NamedSharding(mesh, logical_to_spec((None, None, "kv_heads", None)))
