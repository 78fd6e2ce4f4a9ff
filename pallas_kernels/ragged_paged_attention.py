"""Ragged paged attention over per-request segment ids, as one call of two Pallas kernels.

The kernel contract (docs/design.md, "The kernel contract"):

    ragged_paged_attention(q[T, Hq, Dh], k_pages[P, page, Hkv, Dh], v_pages[P, page, Hkv, Dh],
                           segment_ids[T], positions[T], block_tables[S, max_pages], kv_lens[S],
                           *, sm_scale, sliding_window=None, soft_cap=None, interpret=False) -> [T, Hq, Dh]

Token t of segment s attends to the cached tokens of s at positions <= positions[t] (its own K/V is
already written), and below kv_lens[s]; with a sliding window W, only to positions > positions[t] - W;
with a soft cap c, each score s becomes c * tanh(s / c) (`check_options`). Grouped-query attention: query head h reads KV head
h // (Hq // Hkv). A token whose segment id is outside [0, S) is padding and gives zeros. Tokens may
come in any order and a segment's tokens need not be contiguous; decode tokens, prefill chunks and
both mixed are one call.

Layout of the computation: two kernels share the call, each row going to one of them.
  - Decode rows: a sequence with exactly one token in the call (a decode step, or a one-token
    chunk) goes to the decode kernel (decode_kernel.py), a grid over (sequences, KV heads) whose
    program holds the sequence's query-head group against its pages, streamed.
  - Every other row (prefill chunks) goes to the query-block kernel below: the grid is (query blocks
    of `block_q` tokens) x (KV heads). A program loads its query block for the G query heads of its
    KV head, then visits each segment present in the block and, for that segment, each KV page up to
    the block's last position in it: every page is read once per program and shared by the G heads.
    Decode rows are padding to it, so a block of decodes only writes zeros.
Both use an online softmax with a finite mask value; masked probabilities are zeroed explicitly, so
a block whose keys are all masked adds nothing (the NaN trap of -inf masks) and a row with no key at
all gives zeros.

Compiled (Triton) both need power-of-two tiles, tl.dot's at least 16 wide: page_size and head_dim are
checked (block_sizes.check_triton_shapes) and the query-head group is padded. Block sizes come from
`BlockSizes`, by default per (head_dim, page_size, dtype) from block_sizes.DEFAULTS. The module
follows jax's own Pallas ops: a block-size dataclass, the kernels, a jitted wrapper that validates its
inputs, and `ragged_paged_attention_reference` in pure jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.block_sizes import BlockSizes, check_triton_shapes, default_block_sizes
from pallas_kernels.decode_kernel import MASK_VALUE, decode_attention, online_softmax_step


def _kernel(
    segment_ids_ref,  # [BQ] int32
    positions_ref,  # [BQ] int32
    q_ref,  # [BQ, G_pad, Dh], already scaled by sm_scale
    block_tables_ref,  # [S, max_pages] int32 (whole array)
    kv_lens_ref,  # [S] int32 (whole array)
    k_pages_ref,  # [P, page, K, Dh] (whole array: a program reads its KV head's pages)
    v_pages_ref,  # [P, page, K, Dh]
    o_ref,  # [BQ, G_pad, Dh]
    *,
    num_seqs: int,
    group: int,
    sliding_window: int | None,
    soft_cap: float | None,
):
    block_q, _, head_dim = q_ref.shape
    page_size = k_pages_ref.shape[1]
    head = pl.program_id(1)
    segments = segment_ids_ref[...]
    positions = positions_ref[...]
    valid = (segments >= 0) & (segments < num_seqs)
    queries = [q_ref[:, g, :] for g in range(group)]  # G x [BQ, Dh]

    def visit_segment(seg, carry):
        rows = valid & (segments == seg)  # [BQ]
        kv_len = kv_lens_ref[seg]
        end = jnp.minimum(jnp.max(jnp.where(rows, positions, -1)) + 1, kv_len)
        # Pages wholly before every row's window are not read.
        start = 0 if sliding_window is None else jnp.maximum(
            jnp.min(jnp.where(rows, positions, jnp.iinfo(jnp.int32).max)) - sliding_window + 1, 0)

        def visit_page(j, carry):
            page = block_tables_ref[seg, j]
            k = k_pages_ref[page, :, head, :]  # [page, Dh]
            v = v_pages_ref[page, :, head, :]
            key_pos = j * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)  # [1, page]
            visible = rows[:, None] & (key_pos <= positions[:, None]) & (key_pos < kv_len)  # [BQ, page]
            if sliding_window is not None:
                visible &= key_pos > positions[:, None] - sliding_window
            return tuple(online_softmax_step(q, k, v, visible, state, soft_cap) for q, state in zip(queries, carry))

        num_visited = pl.cdiv(end, page_size)
        return jax.lax.fori_loop(jnp.minimum(start // page_size, num_visited), num_visited, visit_page, carry)

    first = jnp.min(jnp.where(valid, segments, num_seqs))
    last = jnp.max(jnp.where(valid, segments, -1))
    init = tuple(
        (jnp.full((block_q,), MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
         jnp.zeros((block_q, head_dim), jnp.float32))
        for _ in range(group)
    )
    final = jax.lax.fori_loop(first, last + 1, visit_segment, init)
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # padded heads stay zero
    for g, (_, row_sum, acc) in enumerate(final):
        out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]  # no key at all: zeros
        o_ref[:, g, :] = out.astype(o_ref.dtype)


def check_inputs(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens) -> None:
    """The contract's shapes and dtypes, shared by every implementation of it (native.py too)."""
    def fail(message: str):
        raise ValueError(f"ragged_paged_attention: {message}")

    if q.ndim != 3:
        fail(f"q must be [T, Hq, Dh], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        fail(f"k_pages and v_pages must both be [P, page, Hkv, Dh], got {k_pages.shape} and {v_pages.shape}")
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        fail(f"head dim of q ({head_dim}) and of the pages ({kv_head_dim}) differ")
    if num_heads % num_kv_heads:
        fail(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if segment_ids.shape != (num_tokens,) or positions.shape != (num_tokens,):
        fail(f"segment_ids and positions must be [T={num_tokens}], got {segment_ids.shape} and {positions.shape}")
    if block_tables.ndim != 2 or kv_lens.shape != (block_tables.shape[0],):
        fail(f"block_tables must be [S, max_pages] and kv_lens [S], got {block_tables.shape} and {kv_lens.shape}")
    for name, array in (("segment_ids", segment_ids), ("positions", positions),
                        ("block_tables", block_tables), ("kv_lens", kv_lens)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            fail(f"{name} must be integers, got {array.dtype}")
    if k_pages.dtype != v_pages.dtype:
        fail(f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must share a dtype")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_sizes", "interpret"))
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> jax.Array:
    """See the module docstring (`sliding_window`, `soft_cap`: `check_options`). `block_sizes`: None
    takes the defaults for the shape. `interpret=True` runs the kernel bodies as plain JAX (any
    backend, any shape)."""
    check_inputs(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens)
    check_options(sliding_window, soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, _ = block_tables.shape
    if block_sizes is None:
        block_sizes = default_block_sizes(head_dim, page_size, k_pages.dtype)
    if not interpret:
        check_triton_shapes(head_dim=head_dim, page_size=page_size, block_sizes=block_sizes)
    group = num_heads // num_kv_heads
    queries = (q.astype(jnp.float32) * sm_scale).astype(q.dtype).reshape(num_tokens, num_kv_heads, group, head_dim)
    segments = segment_ids.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)

    # Decode rows: the one token of a sequence that has one token in this call.
    valid = (segments >= 0) & (segments < num_seqs)
    seg_or_none = jnp.where(valid, segments, num_seqs)  # out of range: dropped by the scatters below
    tokens_per_seq = jnp.zeros((num_seqs,), jnp.int32).at[seg_or_none].add(1, mode="drop")
    seg = jnp.clip(segments, 0, num_seqs - 1)
    decode_row = valid & (tokens_per_seq[seg] == 1)  # [T]
    decode_seq = jnp.where(decode_row, segments, num_seqs)
    query_pos = jnp.full((num_seqs,), -1, jnp.int32).at[decode_seq].set(positions, mode="drop")  # [S]
    token_of_seq = jnp.zeros((num_seqs,), jnp.int32).at[decode_seq].set(jnp.arange(num_tokens, dtype=jnp.int32),
                                                                        mode="drop")
    decode_group_pad = max(16, _next_power_of_two(group))  # tl.dot's rows
    decode_queries = jnp.pad(queries[token_of_seq], ((0, 0), (0, 0), (0, decode_group_pad - group), (0, 0)))
    decoded = decode_attention(decode_queries, k_pages, v_pages, query_pos, block_tables, kv_lens,
                               sliding_window=sliding_window, soft_cap=soft_cap,
                               num_warps=block_sizes.decode_num_warps, num_stages=block_sizes.decode_num_stages,
                               interpret=interpret)  # [S, K, G_pad, Dh]
    decoded = decoded[seg, :, :group].reshape(num_tokens, num_heads, head_dim)

    blocked = _query_blocks(queries, k_pages, v_pages, jnp.where(decode_row, num_seqs, segments), positions,
                            block_tables, kv_lens, sliding_window=sliding_window, soft_cap=soft_cap,
                            block_sizes=block_sizes, interpret=interpret)
    return jnp.where(decode_row[:, None, None], decoded, blocked)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _query_blocks(queries, k_pages, v_pages, segments, positions, block_tables, kv_lens, *, sliding_window,
                  soft_cap, block_sizes, interpret):
    """The query-block kernel over queries [T, K, G, Dh] (scaled) -> [T, K * G, Dh]; rows whose
    segment is out of range (padding, and the decode rows) give zeros."""
    num_tokens, num_kv_heads, group, head_dim = queries.shape
    num_seqs = block_tables.shape[0]
    group_pad = _next_power_of_two(group)  # Triton tiles are powers of two
    block_q = block_sizes.block_q
    padded_tokens = pl.cdiv(num_tokens, block_q) * block_q
    queries = jnp.pad(queries, ((0, padded_tokens - num_tokens), (0, 0), (0, group_pad - group), (0, 0)))
    segments = jnp.pad(segments, (0, padded_tokens - num_tokens), constant_values=num_seqs)
    positions = jnp.pad(positions, (0, padded_tokens - num_tokens))

    token_block = pl.BlockSpec((block_q,), lambda i, h: (i,))
    head_block = pl.BlockSpec((block_q, None, group_pad, head_dim), lambda i, h: (i, h, 0, 0))
    # The pages whole, the KV head indexed in the kernel (as in decode_kernel.py, for interpret mode).
    whole = lambda shape: pl.BlockSpec(shape, lambda i, h: (0,) * len(shape))  # noqa: E731
    compiler_params = None
    if not interpret:
        # Always Triton when compiled, whatever backend traces it: without these params jax lowers
        # for GPU through Mosaic GPU, which this kernel's page blocks do not fit (docs/design.md, "The
        # kernel contract"), and with them `jax.export(..., platforms=["cuda"])` checks the GPU lowering
        # on a CPU host.
        from jax.experimental.pallas import triton as pl_triton

        compiler_params = pl_triton.CompilerParams(num_warps=block_sizes.num_warps,
                                                   num_stages=block_sizes.num_stages)
    out = pl.pallas_call(
        functools.partial(_kernel, num_seqs=num_seqs, group=group, sliding_window=sliding_window,
                          soft_cap=soft_cap),
        grid=(padded_tokens // block_q, num_kv_heads),
        in_specs=[token_block, token_block, head_block, whole(block_tables.shape), whole(kv_lens.shape),
                  whole(k_pages.shape), whole(v_pages.shape)],
        out_specs=head_block,
        out_shape=jax.ShapeDtypeStruct(queries.shape, queries.dtype),
        interpret=interpret,
        compiler_params=compiler_params,
        name="ragged_paged_attention",
    )(segments, positions, queries, block_tables, kv_lens, k_pages, v_pages)
    return out[:num_tokens, :, :group].reshape(num_tokens, num_kv_heads * group, head_dim)


def check_options(sliding_window: int | None, soft_cap: float | None) -> None:
    """The contract's two optional terms, shared by every implementation:

    - `sliding_window` (tokens): a token at position p sees only keys at positions > p - window,
      i.e. the last `window` positions, its own included (Mistral, Gemma's local layers); None: all.
    - `soft_cap`: each score s (after sm_scale) becomes soft_cap * tanh(s / soft_cap) before the
      softmax (Gemma 2); None: scores as they are.
    """
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"ragged_paged_attention: sliding_window must be a positive int (tokens) or None, "
                         f"got {sliding_window!r}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"ragged_paged_attention: soft_cap must be > 0 or None, got {soft_cap!r}")


def ragged_paged_attention_reference(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens, *,
                                     sm_scale: float, sliding_window: int | None = None,
                                     soft_cap: float | None = None) -> jax.Array:
    """The contract in plain jnp, float32 math, one dense softmax per token: the tests' oracle."""
    check_options(sliding_window, soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_pages = block_tables.shape
    valid = (segment_ids >= 0) & (segment_ids < num_seqs)
    seg = jnp.clip(segment_ids, 0, num_seqs - 1)
    keys = k_pages[block_tables[seg]].reshape(num_tokens, max_pages * page_size, num_kv_heads, head_dim)
    values = v_pages[block_tables[seg]].reshape(num_tokens, max_pages * page_size, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    keys = jnp.repeat(keys.astype(jnp.float32), group, axis=2)  # [T, L, Hq, Dh]
    values = jnp.repeat(values.astype(jnp.float32), group, axis=2)
    scores = jnp.einsum("thd,tlhd->thl", q.astype(jnp.float32), keys) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    key_pos = jnp.arange(max_pages * page_size)
    visible = valid[:, None] & (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] < kv_lens[seg][:, None])
    if sliding_window is not None:
        visible &= key_pos[None, :] > positions[:, None] - sliding_window
    scores = jnp.where(visible[:, None, :], scores, -jnp.inf)
    any_visible = visible.any(axis=1)[:, None, None]
    probs = jax.nn.softmax(jnp.where(any_visible, scores, 0.0), axis=-1)
    out = jnp.einsum("thl,tlhd->thd", probs, values)
    return jnp.where(any_visible, out, 0.0).astype(q.dtype)
