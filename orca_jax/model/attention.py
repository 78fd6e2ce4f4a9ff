"""Self-attention over the ragged token axis.

Every token of every request sits on one axis `T`; `segment_ids[T]` says which request a token
belongs to and `positions[T]` where it sits in that request. `attend` is the single call site where
the engine's paged KV cache and the Pallas kernel (`pallas_kernels.ragged_paged_attention`) plug in;
today it is a full-sequence, segment-masked attention over the tokens of this call.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from orca_jax.model.layers import Dense
from orca_jax.model.rotary import apply_rope

# Finite, so a row with every key masked gives zeros instead of NaN (exp(-inf - -inf) = NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Per-call attention inputs: an explicit pytree argument, never module state."""

    positions: Int[Array, " T"]  # position of each token inside its own sequence
    segment_ids: Int[Array, " T"]  # sequence each token belongs to; padding gets an id of its own


def attend(
    q: Float[Array, "T H Dh"],
    k: Float[Array, "T K Dh"],
    v: Float[Array, "T K Dh"],
    meta: AttentionMetadata,
    sm_scale: float,
) -> Float[Array, "T H Dh"]:
    """Token t attends to every token s of the same segment with positions[s] <= positions[t]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.reshape(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [T, K, G, Dh]
    scores = jnp.einsum("tkgd,skd->kgts", q, k, preferred_element_type=jnp.float32) * sm_scale  # [K, G, T, T]
    same_segment = meta.segment_ids[:, None] == meta.segment_ids[None, :]  # [T, T]
    causal = meta.positions[None, :] <= meta.positions[:, None]
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
        rope_theta: float | None,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        def proj(heads: int, axis: str) -> Dense:
            return Dense((d_model,), (heads, head_dim), ("embed",), (axis, "head_dim"),
                         use_bias=use_bias, dtype=dtype, rngs=rngs)

        self.q = proj(num_heads, "q_heads")
        self.k = proj(num_kv_heads, "kv_heads")
        self.v = proj(num_kv_heads, "kv_heads")
        self.o = Dense((num_heads, head_dim), (d_model,), ("q_heads", "head_dim"), ("embed",),
                       use_bias=use_bias, dtype=dtype, rngs=rngs)
        self.rope_theta = rope_theta  # None: positions come from a learned embedding instead
        self.sm_scale = 1.0 / math.sqrt(head_dim)

    def __call__(self, x: Float[Array, "T D"], meta: AttentionMetadata) -> Float[Array, "T D"]:
        q, k, v = self.q(x), self.k(x), self.v(x)  # [T, H, Dh], [T, K, Dh], [T, K, Dh]
        if self.rope_theta is not None:
            q = apply_rope(q, meta.positions, self.rope_theta)
            k = apply_rope(k, meta.positions, self.rope_theta)
        return self.o(attend(q, k, v, meta, self.sm_scale))
