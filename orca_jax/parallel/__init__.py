"""Device meshes and the logical-axis rules that place parameters and KV pages on them."""

from orca_jax.parallel.mesh import LOGICAL_AXIS_RULES, kv_cache_sharding, make_mesh, param_shardings

__all__ = ["LOGICAL_AXIS_RULES", "kv_cache_sharding", "make_mesh", "param_shardings"]
