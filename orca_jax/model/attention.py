"""Self-attention over the ragged token axis.

Every token of every request sits on one axis `T`; `segment_ids[T]` says which request a token
belongs to and `positions[T]` where it sits in that request. Two paths: `attend`, a dense
segment-masked attention among the tokens of one call (no cache), and, with the engine's paged KV
cache, a `PagedAttention` function: `paged_attention.paged_attention` (write the new K/V, then the
kernel contract), chosen once by the runner, which wraps it per shard under tensor parallelism. The
model never names an implementation or a mesh axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from orca_jax.model.layers import Dense, RMSNorm, dense_all
from orca_jax.model.linear import LinearPlan, all_float
from orca_jax.model.paged_attention import MASK_VALUE, paged_attention
from orca_jax.model.rotary import Rotary, Rotations, rotate, rotation_tables

# The (k_pages, v_pages) a layer's attention writes and reads, each [P, page, K, Dh] (with a KVCache:
# every layer's pages, of which its attention function is given its own range).
LayerKV = tuple[jax.Array, jax.Array]
# (q [T,H,Dh], k [T,K,Dh], v [T,K,Dh], kv, meta, *, sm_scale, pages) -> (out [T,H,Dh], kv): see paged_attention.
PagedAttention = Callable[..., tuple[jax.Array, LayerKV]]


# The most elements one KV array may hold: kernels index a page's rows with 32-bit offsets (a
# Triton kernel's pointer arithmetic among them).
MAX_KV_ARRAY_ELEMENTS = 2**31 - 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The paged KV cache of a run of layers in a few arrays: `k[a]` and `v[a]`, each [n * P, page,
    K, Dh], hold the P pages (the engine's pages and the scratch page) of n = `layers_per_array`
    consecutive layers, layer i in array i // n at pages [(i % n) * P, (i % n + 1) * P). As many
    layers share an array as stay under MAX_KV_ARRAY_ELEMENTS (all of them on a CPU), because a
    compiled step takes the cache and gives it back (donated), and each array it gives back costs
    host time to make: SmolLM2's 60 per-layer arrays took about 0.13 ms of a step's dispatch on an
    idle AMD EPYC Zen 4, and about 0.23 ms of the main thread's CPU while the kernels ran. A layer's
    attention is given its range (`pages`), so it reads and writes its own pages in place."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pages_per_layer: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def zeros(cls, num_layers: int, layer_shape: tuple[int, int, int, int], dtype, sharding=None) -> "KVCache":
        """A cache of `num_layers` layers of `layer_shape` [P, page, K, Dh] each, zeros."""
        pages, row = layer_shape[0], math.prod(layer_shape[1:])
        per_array = max(1, min(num_layers, MAX_KV_ARRAY_ELEMENTS // max(pages * row, 1)))
        # One compiled zeros per array shape (at most two: the full arrays and a shorter last one),
        # not one per array: a large model's cache on a GPU is tens of arrays.
        zeros = functools.cache(lambda shape: jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding))
        k, v = [], []
        for first in range(0, num_layers, per_array):
            shape = ((min(num_layers, first + per_array) - first) * pages,) + tuple(layer_shape[1:])
            k.append(zeros(shape)())
            v.append(zeros(shape)())
        return cls(tuple(k), tuple(v), pages)

    @property
    def layers_per_array(self) -> int:
        return self.k[0].shape[0] // self.pages_per_layer

    @property
    def num_layers(self) -> int:
        return sum(array.shape[0] for array in self.k) // self.pages_per_layer

    def where(self, layer: int) -> tuple[int, tuple[int, int]]:
        """Layer `layer`'s array index and (first page, page count) in it."""
        index, within = divmod(layer, self.layers_per_array)
        return index, (within * self.pages_per_layer, self.pages_per_layer)

    def layer(self, layer: int) -> LayerKV:
        """Layer `layer`'s (k_pages, v_pages), [P, page, K, Dh] each (a copy: for reading)."""
        index, (first, count) = self.where(layer)
        return self.k[index][first:first + count], self.v[index][first:first + count]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-call attention inputs: an explicit pytree argument, never module state.

    Without the paged-cache fields, tokens attend only among the tokens of this call (full-sequence
    forward passes: tests, training, the recompute generator). With them (the engine), new K/V are
    written to the cache and attention reads the whole cached context.
    """

    positions: Int[Array, " T"]  # position of each token inside its own sequence
    segment_ids: Int[Array, " T"]  # sequence each token belongs to; padding: out of range [0, S)
    slot_mapping: Int[Array, " T"] | None = None  # cache slot each new K/V is written to
    block_tables: Int[Array, "S max_pages"] | None = None  # KV pages of each sequence
    kv_lens: Int[Array, " S"] | None = None  # cached tokens per sequence after this call's writes
    # Tokens before the bucket's padding (a step's tokens come first): the native matmuls skip the
    # rows after it. None: every row is real.
    num_tokens: Int[Array, ""] | None = None
    # cos and sin of the tokens' rotary angles, computed on the host (rotary.py). None: from `positions`.
    rotations: Rotations | None = None


def attend(
    q: Float[Array, "T H Dh"],
    k: Float[Array, "T K Dh"],
    v: Float[Array, "T K Dh"],
    meta: AttentionMetadata,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> Float[Array, "T H Dh"]:
    """Token t attends to every token s of the same segment with positions[s] <= positions[t]
    (and > positions[t] - sliding_window); scores soft-capped if asked, as the kernel contract."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [T, K, G, Dh]
    scores = jnp.einsum("tkgd,skd->kgts", q, k, preferred_element_type=jnp.float32) * sm_scale  # [K, G, T, T]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    same_segment = meta.segment_ids[:, None] == meta.segment_ids[None, :]  # [T, T]
    causal = meta.positions[None, :] <= meta.positions[:, None]
    if sliding_window is not None:
        causal &= meta.positions[None, :] > meta.positions[:, None] - sliding_window
    scores = jnp.where(same_segment & causal, scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)  # [T, K, G, Dh]
    return out.reshape(num_tokens, num_heads, head_dim)


class Attention(nnx.Module):
    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        use_bias: bool,
        rotary: Rotary | None,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        sm_scale: float | None = None,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        linear: LinearPlan = all_float,
    ):
        """`use_bias`: biases on every projection (GPT-2); `qkv_bias`: on q, k, v only (Qwen2);
        `qk_norm_eps`: RMSNorm each head's q and k over Dh with this eps before rotary (Qwen3);
        `sliding_window` (tokens), `soft_cap`: the kernel contract's optional terms (Mistral, Gemma);
        `sm_scale`: the score scale, 1/sqrt(head_dim) unless given; `linear`: each projection's
        method ("q", "k", "v", "o")."""
        def proj(name: str, heads: int, axis: str) -> Dense:
            return Dense((d_model,), (heads, head_dim), ("embed",), (axis, "head_dim"),
                         use_bias=use_bias or qkv_bias, dtype=dtype, rngs=rngs, method=linear(name))

        self.q = proj("q", num_heads, "q_heads")
        self.k = proj("k", num_kv_heads, "kv_heads")
        self.v = proj("v", num_kv_heads, "kv_heads")
        self.o = Dense((num_heads, head_dim), (d_model,), ("q_heads", "head_dim"), ("embed",),
                       use_bias=use_bias, dtype=dtype, rngs=rngs, method=linear("o"))
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps, dtype)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, qk_norm_eps, dtype)
        self.rotary = rotary  # None: positions come from a learned embedding instead
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
        # Passed only when set, so an implementation without them still serves models that need neither.
        self.options = {name: value for name, value in (("sliding_window", sliding_window), ("soft_cap", soft_cap))
                        if value is not None}

    def __call__(
        self, x: Float[Array, "T D"], meta: AttentionMetadata, kv: LayerKV | None = None,
        attention: PagedAttention = paged_attention,
    ) -> tuple[Float[Array, "T D"], LayerKV | None]:
        rows = meta.num_tokens
        q, k, v = dense_all([self.q, self.k, self.v], x, rows)  # [T, H, Dh], [T, K, Dh], [T, K, Dh]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = rotation_tables(self.rotary, meta.positions, meta.rotations)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        if kv is None:
            return self.o(attend(q, k, v, meta, self.sm_scale, **self.options), rows), None
        out, kv = attention(q, k, v, kv, meta, sm_scale=self.sm_scale, **self.options)
        return self.o(out, rows), kv
