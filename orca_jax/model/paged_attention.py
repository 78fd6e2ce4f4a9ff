"""The paged KV cache as the model sees it: writing new K/V into pages, and the XLA implementation
of the kernel contract (docs/design.md, "The kernel contract"):

    ragged_paged_attention(q[T,H,Dh], k_pages[P,page,K,Dh], v_pages[P,page,K,Dh], segment_ids[T],
                           positions[T], block_tables[S,max_pages], kv_lens[S], *, sm_scale,
                           sliding_window=None, soft_cap=None) -> [T,H,Dh]

Token t of segment s attends to the cached tokens of s at positions <= positions[t] (and inside its
sliding window, if any); its own K/V is already written. Tokens with a segment id outside [0, S) are
padding and give zeros.

The XLA version splits each token's keys in two, sharing one online softmax:
  1. the tokens of this call (a prefill chunk, or a decode's single token): their K/V are read back
     from the pages at their own slots and attended densely, [T, T] with a segment + causal mask;
  2. the context cached before the call's first token of the segment, read page-block by
     page-block in a loop whose trip count follows the longest context *at run time*, so a prefill
     with no cached context costs nothing here and no context-length bucket is compiled.
Precondition (how the engine calls it): within one call, a segment's tokens are its latest positions,
consecutive, ending at kv_lens - 1. For speed (not correctness) decode tokens come first.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Finite, so a row with every key masked gives zeros instead of NaN (exp(-inf - -inf) = NaN).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

KVPages = Float[Array, "P page K Dh"]
PAGES_PER_BLOCK = 8  # context pages gathered per loop iteration


def write_kv(
    k_pages: KVPages, v_pages: KVPages, k: Float[Array, "T K Dh"], v: Float[Array, "T K Dh"],
    slot_mapping: Int[Array, " T"], pages: tuple[int, int] | None = None,
) -> tuple[KVPages, KVPages]:
    """Scatters this call's K/V to their slots (page * page_size + offset); padding tokens write to
    a scratch slot no request owns. In place when the caller donates the pages. `pages` (first,
    count): the layer's range when the arrays hold several layers' pages (attention.KVCache); the
    slots count from its first page and lie in it."""
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    if pages is not None:
        slot_mapping = slot_mapping + pages[0] * page_size
    flat_shape = (num_pages * page_size, num_kv_heads, head_dim)
    k_pages = k_pages.reshape(flat_shape).at[slot_mapping].set(k.astype(k_pages.dtype)).reshape(k_pages.shape)
    v_pages = v_pages.reshape(flat_shape).at[slot_mapping].set(v.astype(v_pages.dtype)).reshape(v_pages.shape)
    return k_pages, v_pages


def ragged_paged_attention_xla(
    q: Float[Array, "T H Dh"],
    k_pages: KVPages,
    v_pages: KVPages,
    segment_ids: Int[Array, " T"],
    positions: Int[Array, " T"],
    block_tables: Int[Array, "S max_pages"],
    kv_lens: Int[Array, " S"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages: tuple[int, int] | None = None,
) -> Float[Array, "T H Dh"]:
    del kv_lens  # implied by the precondition: the call's last token of a segment is its last position
    block_tables = _from_first_page(block_tables, pages)
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    group = num_heads // num_kv_heads
    valid = (segment_ids >= 0) & (segment_ids < num_seqs)  # [T]
    seg = jnp.clip(segment_ids, 0, num_seqs - 1)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32) * sm_scale  # [T, K, G, Dh]

    # 1. This call's own tokens, read back from their slots.
    page_index = jnp.clip(positions // page_size, 0, max_pages - 1)
    slots = block_tables[seg, page_index] * page_size + positions % page_size  # [T]
    k_flat = k_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_pages * page_size, num_kv_heads, head_dim)
    k_new = k_flat[slots].astype(jnp.float32)  # [T, K, Dh]
    # Padding tokens read some slot back; zero their values so no stale (or NaN) row leaks in as 0 x NaN.
    v_new = jnp.where(valid[:, None, None], v_flat[slots].astype(jnp.float32), 0.0)
    scores = _cap(jnp.einsum("tkgd,skd->tkgs", qg, k_new), soft_cap)  # [T, K, G, T]
    visible = (seg[:, None] == seg[None, :]) & valid[None, :] & (positions[None, :] <= positions[:, None])
    if sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    row_max = scores.max(axis=-1)  # [T, K, G]
    probs = jnp.exp(scores - row_max[..., None])
    row_sum = probs.sum(axis=-1)
    acc = jnp.einsum("tkgs,skd->tkgd", probs, v_new)  # [T, K, G, Dh]

    # 2. Context cached before the call: positions [0, first position of the segment in this call).
    big = jnp.iinfo(jnp.int32).max
    first = jnp.full((num_seqs,), big, jnp.int32).at[seg].min(jnp.where(valid, positions, big))
    context_len = jnp.where(valid, first[seg], 0)  # [T]
    token_tables = block_tables[seg]  # [T, max_pages]
    carry = (row_max, row_sum, acc)
    # Two row groups, each looping only as far as its own longest context: the engine puts decode
    # tokens (at most S of them) first, so a step that mixes decodes with fresh prompts pays the
    # context loop for S rows, not T.
    split = min(num_seqs, num_tokens)
    groups = [slice(0, split), slice(split, num_tokens)] if split < num_tokens else [slice(0, num_tokens)]
    # Keys at positions >= window_start[t] are inside token t's window (all of them without one).
    window_start = jnp.zeros_like(positions) if sliding_window is None else positions - sliding_window + 1
    parts = [
        _attend_context(qg[g], token_tables[g], context_len[g], window_start[g], k_pages, v_pages,
                        tuple(c[g] for c in carry), soft_cap)
        for g in groups
    ]
    row_max, row_sum, acc = (jnp.concatenate([p[i] for p in parts]) for i in range(3))
    out = acc / row_sum[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)


def _cap(scores, soft_cap: float | None):
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def _attend_context(qg, token_tables, context_len, window_start, k_pages, v_pages, carry, soft_cap):
    """Continues the online softmax of rows `qg` [R, K, G, Dh] over their cached context, a block of
    PAGES_PER_BLOCK pages per iteration; the trip count follows the longest context at run time, and
    blocks wholly before every row's window start are not read."""
    num_rows, num_kv_heads, _, head_dim = qg.shape
    page_size = k_pages.shape[1]
    max_pages = token_tables.shape[1]
    block_tokens = PAGES_PER_BLOCK * page_size
    num_blocks = (context_len.max(initial=0) + block_tokens - 1) // block_tokens
    has_context = context_len > 0
    first_block = jnp.where(has_context, jnp.maximum(window_start, 0), jnp.iinfo(jnp.int32).max).min(
        initial=jnp.iinfo(jnp.int32).max) // block_tokens

    def attend_block(j, carry):
        row_max, row_sum, acc = carry
        page_slots = j * PAGES_PER_BLOCK + jnp.arange(PAGES_PER_BLOCK)  # [B]
        pages = jnp.take(token_tables, jnp.clip(page_slots, 0, max_pages - 1), axis=1)  # [R, B]
        k_blk = k_pages[pages].reshape(num_rows, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        v_blk = v_pages[pages].reshape(num_rows, block_tokens, num_kv_heads, head_dim).astype(jnp.float32)
        key_pos = j * block_tokens + jnp.arange(block_tokens)  # [L]
        s = _cap(jnp.einsum("tkgd,tlkd->tkgl", qg, k_blk), soft_cap)  # [R, K, G, L]
        visible = (key_pos[None, :] < context_len[:, None]) & (key_pos[None, :] >= window_start[:, None])
        s = jnp.where(visible[:, None, None, :], s, MASK_VALUE)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        scale = jnp.exp(row_max - new_max)
        p = jnp.exp(s - new_max[..., None])
        return new_max, row_sum * scale + p.sum(axis=-1), acc * scale[..., None] + jnp.einsum("tkgl,tlkd->tkgd", p, v_blk)

    return jax.lax.fori_loop(jnp.minimum(first_block, num_blocks), num_blocks, attend_block, carry)


def _from_first_page(block_tables, pages: tuple[int, int] | None):
    """Page numbers relative to a layer's first page (`pages`, see write_kv) as indices of the arrays."""
    return block_tables if pages is None else block_tables + pages[0]


def _pallas(interpret: bool):
    def call(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens, *, sm_scale,
             sliding_window=None, soft_cap=None, pages=None):
        from pallas_kernels import ragged_paged_attention as kernel

        return kernel(q, k_pages, v_pages, segment_ids, positions, _from_first_page(block_tables, pages), kv_lens,
                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)

    return call


def _native(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens, *, sm_scale,
            sliding_window=None, soft_cap=None, pages=None):
    from pallas_kernels.native import ragged_paged_attention_native

    return ragged_paged_attention_native(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens,
                                         sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                         pages=pages)


def _native_write_kv(k_pages, v_pages, k, v, slot_mapping, pages=None):
    from pallas_kernels.native import write_kv_native

    return write_kv_native(k_pages, v_pages, k, v, slot_mapping, pages)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    # The kernel contract above, and (k_pages, v_pages, k, v, slot_mapping) -> (k_pages, v_pages).
    # Both also take `pages=(first, count)`, a layer's range in arrays holding several layers' pages,
    # from whose first page the page numbers and slots count: the native kernels offset their
    # pointers by it, the others shift the page numbers and slots.
    attend: Callable
    write_kv: Callable = write_kv


# By attention_impl, as backends.resolve_attention_impl resolves it: "pallas" compiles the kernel
# (Triton on GPU); "pallas-interpret" runs its body as plain JAX on any backend (slow: for checking
# the kernel inside the engine on CPU); "native" is the C++ CPU kernel, which also writes the K/V
# itself, because XLA:CPU's scatter into bfloat16 pages converts the whole array.
ATTENTION_BACKENDS = {
    "xla": AttentionBackend(ragged_paged_attention_xla),
    "pallas": AttentionBackend(_pallas(interpret=False)),
    "pallas-interpret": AttentionBackend(_pallas(interpret=True)),
    "native": AttentionBackend(_native, _native_write_kv),
}


def paged_attention(q: Float[Array, "T H Dh"], k: Float[Array, "T K Dh"], v: Float[Array, "T K Dh"],
                    kv: tuple[KVPages, KVPages], meta, *, sm_scale: float, sliding_window: int | None = None,
                    soft_cap: float | None = None, impl: str = "xla", pages: tuple[int, int] | None = None):
    """One layer's cache step: writes this call's K/V into the pages, then attends over them, both
    as the backend `impl` (a key of ATTENTION_BACKENDS) does them (`sliding_window`, `soft_cap`: the
    contract's optional terms, see pallas_kernels.ragged_paged_attention.check_options). Returns (out [T, H, Dh], (k_pages, v_pages)).
    `meta` is the layer's AttentionMetadata. `pages` (first, count): the layer's pages when `kv`
    holds every layer's (attention.KVCache); meta's page numbers and slots count from `first`.
    Under tensor parallelism this whole function runs per shard of heads."""
    backend = ATTENTION_BACKENDS[impl]
    k_pages, v_pages = backend.write_kv(*kv, k, v, meta.slot_mapping, pages=pages)
    out = backend.attend(q, k_pages, v_pages, meta.segment_ids, meta.positions, meta.block_tables,
                         meta.kv_lens, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                         pages=pages)
    return out, (k_pages, v_pages)
