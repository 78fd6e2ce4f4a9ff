"""Tensor parallelism pieces that are not a placement rule: attention per shard of heads, and
KV heads replicated for a `tp` larger than the model's KV head count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from orca_jax.model.attention import PagedAttention
from orca_jax.model.paged_attention import paged_attention
from orca_jax.parallel.mesh import KV_HEADS_SPEC, KV_PAGES_SPEC, Q_HEADS_SPEC


def sharded_paged_attention(impl: str, mesh: Mesh) -> PagedAttention:
    """The model's paged-attention function for this mesh, implementation `impl` fixed here.

    With tp > 1 it runs inside `shard_map`: each device writes and reads only its own KV heads and
    attends with its own query heads (heads never interact in attention), so the kernel, Pallas or
    XLA, sees an ordinary single-device problem. The metadata is replicated."""
    attention = functools.partial(paged_attention, impl=impl)
    if mesh.size == 1:
        return attention

    def per_shard(q, k, v, kv, meta, **options):  # sm_scale, sliding_window, soft_cap
        body = functools.partial(attention, **options)
        return jax.shard_map(
            body, mesh=mesh,
            in_specs=(Q_HEADS_SPEC, KV_HEADS_SPEC, KV_HEADS_SPEC, (KV_PAGES_SPEC, KV_PAGES_SPEC), PartitionSpec()),
            out_specs=(Q_HEADS_SPEC, (KV_PAGES_SPEC, KV_PAGES_SPEC)),
            check_vma=False,
        )(q, k, v, kv, meta)

    return per_shard


def replicate_kv_heads(state, num_kv_heads: int):
    """Returns a decoder state whose K/V projections have `num_kv_heads` heads (a multiple of the
    model's count), each original head repeated in place, so tensor parallelism can give every
    device whole KV heads. Query head h keeps reading a copy of its own KV head: with G = H / K
    queries per KV head before and r copies of each, h // (G / r) // r == h // G. Done once at load
    on the runner's copy of the state (the loaded model is untouched); outputs are unchanged."""

    def widen(path, x):
        kind = _kv_projection_leaf(path)
        if kind is None:
            return x
        head_axis = -2 if kind == "kernel" else 0  # kernel [D, K, Dh], bias [K, Dh]
        return jnp.repeat(x, num_kv_heads // x.shape[head_axis], axis=head_axis)

    return jax.tree_util.tree_map_with_path(widen, state)


def kv_projections_replicated(shardings, replicated):
    """`shardings` with the K/V projections' leaves set to `replicated` (where they are restored
    before `replicate_kv_heads` widens them)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: replicated if _kv_projection_leaf(path) is not None else s, shardings)


def _kv_projection_leaf(path) -> str | None:
    """"kernel" or "bias" for a leaf of a K or V projection, else None."""
    names = [str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path]
    i = names.index("attn") if "attn" in names else -1
    if i < 0 or names[i + 1] not in ("k", "v"):
        return None
    return names[i + 2]
