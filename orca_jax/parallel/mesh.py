"""Meshes and placement by logical axis names.

Model parameters carry logical axis names (`orca_jax.model.LOGICAL_AXES`); `LOGICAL_AXIS_RULES` is
the one table that maps them to mesh axes. Tensor parallelism splits the query heads, the KV heads,
the MLP width and the vocabulary over 'tp' (Megatron style). Pipeline parallelism is not a mesh axis:
each stage is its own program on its own mesh of `tp` devices (`stage_meshes`), and the runner moves
activations between them, because sharding stacked layers over a 'pp' axis would make XLA gather
them, not pipeline them (docs/design.md, "The device side").
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from orca_jax.config import ConfigError, ParallelConfig

TP_AXIS = "tp"

LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": TP_AXIS,
    "embed": None,
    "positions": None,
    "q_heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "head_dim": None,
    "mlp": TP_AXIS,
    "norm": None,
}


def stage_meshes(parallel: ParallelConfig, devices: list | None = None) -> list[Mesh]:
    """One mesh of `tensor_parallel_size` devices per pipeline stage, in device order (on several
    processes, jax.devices() lists each process's devices together, so a stage stays on one host
    when tp divides a host's device count)."""
    devices = list(jax.devices() if devices is None else devices)
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if tp * pp > len(devices):
        raise ConfigError(
            f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} = {tp * pp} devices, but only "
            f"{len(devices)} {jax.default_backend()} device(s) are visible; lower the sizes (or, to try a "
            f"layout on CPU, set JAX_NUM_CPU_DEVICES={tp * pp} before starting)")
    grid = np.array(devices[:tp * pp]).reshape(pp, tp)
    # Mesh(...) gives Auto axes on every jax version (jax.make_mesh defaults to Explicit in 0.10).
    return [Mesh(row, (TP_AXIS,)) for row in grid]


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


# KV pages [P, page, K, Dh] split by KV head, like the K/V projections that write them; per-token
# head tensors [T, H or K, Dh] split the same way.
KV_PAGES_SPEC = logical_to_spec((None, None, "kv_heads", None))
Q_HEADS_SPEC = logical_to_spec((None, "q_heads", None))
KV_HEADS_SPEC = logical_to_spec((None, "kv_heads", None))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, KV_PAGES_SPEC)
