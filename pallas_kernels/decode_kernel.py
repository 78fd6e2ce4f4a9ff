"""The decode-shaped kernel: one program per (sequence, KV head), for sequences with one query token.

A decode row is one token; in the query-block kernel it would fill one row of a 16-row block and
share the block's programs with other sequences. Here a program takes one sequence's token and the
whole query-head group of one KV head (GQA: G query heads, padded to a tile of at least 16 rows for
tl.dot), and streams that sequence's pages of that KV head through an online softmax, each page
read once and shared by the G heads; Triton keeps `decode_num_stages` page loads in flight. 32
decodes of an 8-KV-head model make 256 programs, where the query-block grid made 16.

The wrapper (ragged_paged_attention.py) gathers each sequence's single token into `q[S, K, G_pad,
Dh]` and scatters the outputs back; a sequence without such a token has query position -1 and its
program reads nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

# Finite, so exp(MASK - MASK) stays finite; masked probabilities are also zeroed explicitly.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def online_softmax_step(q, k, v, visible, state, soft_cap):
    """One page of keys for rows q [R, Dh] (both kernels): scores against k [page, Dh], soft-capped
    if asked, masked by visible [R, page] (masked probabilities exactly zero), folded into the
    online-softmax state (row_max [R], row_sum [R], acc [R, Dh]) with v [page, Dh]."""
    row_max, row_sum, acc = state
    scores = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)  # [R, page]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, MASK_VALUE)
    new_max = jnp.maximum(row_max, scores.max(axis=1))
    correction = jnp.exp(row_max - new_max)
    probs = jnp.where(visible, jnp.exp(scores - new_max[:, None]), 0.0)
    pv = jax.lax.dot(probs.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)  # [R, Dh]
    return new_max, row_sum * correction + probs.sum(axis=1), acc * correction[:, None] + pv


def _decode_kernel(
    query_pos_ref,  # [S] int32 (whole array): the sequence's query position, -1: no query
    block_tables_ref,  # [S, max_pages] int32 (whole array)
    kv_lens_ref,  # [S] int32 (whole array)
    q_ref,  # [G_pad, Dh]: this sequence's token, this KV head's query heads, scaled by sm_scale
    k_pages_ref,  # [P, page, K, Dh] (whole array: a program reads its pages of its KV head)
    v_pages_ref,  # [P, page, K, Dh]
    o_ref,  # [G_pad, Dh]
    *,
    sliding_window: int | None,
    soft_cap: float | None,
):
    seq, head = pl.program_id(0), pl.program_id(1)
    group_pad, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    query_pos = query_pos_ref[seq]
    end = jnp.minimum(query_pos + 1, kv_lens_ref[seq])  # keys [start, end) are visible
    start = 0 if sliding_window is None else jnp.maximum(query_pos - sliding_window + 1, 0)
    q = q_ref[...]

    def visit_page(j, carry):
        page = block_tables_ref[seq, j]
        k = k_pages_ref[page, :, head, :]  # [page, Dh]
        v = v_pages_ref[page, :, head, :]
        key_pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # [1, page]
        visible = (key_pos < end) & (key_pos >= start)  # [1, page], for all G_pad rows
        return online_softmax_step(q, k, v, visible, carry, soft_cap)

    init = (jnp.full((group_pad,), MASK_VALUE, jnp.float32), jnp.zeros((group_pad,), jnp.float32),
            jnp.zeros((group_pad, head_dim), jnp.float32))
    num_visited = pl.cdiv(jnp.maximum(end, 0), page_size)  # pages wholly before the window are not read
    _, row_sum, acc = jax.lax.fori_loop(jnp.minimum(start // page_size, num_visited), num_visited, visit_page, init)
    o_ref[...] = (acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]).astype(o_ref.dtype)  # no key: zeros


def decode_attention(queries, k_pages, v_pages, query_pos, block_tables, kv_lens, *, sliding_window: int | None,
                     soft_cap: float | None, num_warps: int, num_stages: int, interpret: bool):
    """queries [S, K, G_pad, Dh] (scaled), pages [P, page, K, Dh], query_pos / kv_lens [S],
    block_tables [S, max_pages] -> [S, K, G_pad, Dh]; `sliding_window`, `soft_cap` as in the
    contract (ragged_paged_attention.check_options)."""
    num_seqs, num_kv_heads, group_pad, head_dim = queries.shape
    head_block = pl.BlockSpec((None, None, group_pad, head_dim), lambda s, h: (s, h, 0, 0))
    # The pages as whole arrays, the KV head indexed in the kernel: a block of one head's pages would
    # be copied out of the pool for every program in interpret mode (10x slower on CPU).
    whole = lambda shape: pl.BlockSpec(shape, lambda s, h: (0,) * len(shape))  # noqa: E731
    compiler_params = None
    if not interpret:  # Triton, never Mosaic GPU (see ragged_paged_attention.py)
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_decode_kernel, sliding_window=sliding_window, soft_cap=soft_cap),
        grid=(num_seqs, num_kv_heads),
        in_specs=[whole(query_pos.shape), whole(block_tables.shape), whole(kv_lens.shape), head_block,
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=head_block,
        out_shape=jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention_decode",
    )(query_pos, block_tables, kv_lens, queries, k_pages, v_pages)
