"""Device meshes, the logical-axis rules that place parameters and KV pages on them, and the
checks and memory plan for a tensor x pipeline parallel layout.

`layout` is pure Python (the CLI and config checks use it without jax), so the mesh helpers that
need jax are imported on first use rather than here.
"""

_MESH_EXPORTS = ("LOGICAL_AXIS_RULES", "kv_cache_sharding", "make_mesh", "param_shardings")

__all__ = list(_MESH_EXPORTS)


def __getattr__(name: str):
    if name in _MESH_EXPORTS:
        from orca_jax.parallel import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
