"""Scale-out: the logical-axis rules and stage meshes (mesh.py), tensor-parallel attention
(tensor_parallel.py), layout checks (layout.py), the memory plan (memory_plan.py) and
multi-host processes and the plan channel (multihost.py; the follower loop is runner/follower.py).

`layout` is pure Python (the CLI and config checks use it without jax), so the mesh helpers that
need jax are imported on first use rather than here.
"""

_MESH_EXPORTS = ("LOGICAL_AXIS_RULES", "kv_cache_sharding", "param_shardings", "stage_meshes")

__all__ = list(_MESH_EXPORTS)


def __getattr__(name: str):
    if name in _MESH_EXPORTS:
        from orca_jax.parallel import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
