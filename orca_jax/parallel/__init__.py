"""Scale-out: the logical-axis rules and stage meshes (mesh.py), tensor-parallel attention
(tensor_parallel.py), layouts and their checks (layout.py, no jax)."""

from orca_jax.parallel.mesh import LOGICAL_AXIS_RULES, kv_cache_sharding, param_shardings, stage_meshes

__all__ = ["LOGICAL_AXIS_RULES", "kv_cache_sharding", "param_shardings", "stage_meshes"]
