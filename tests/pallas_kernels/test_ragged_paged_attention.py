"""The implementations of the kernel contract against its pure-jnp reference: the Pallas kernel
(interpret mode on CPU), the native C++ kernel and, where its precondition holds, the XLA path."""

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.model.paged_attention import ragged_paged_attention_xla
from pallas_kernels import BlockSizes, ragged_paged_attention, ragged_paged_attention_reference
from pallas_kernels.native import ragged_paged_attention_native

from ..conftest import require_native

# The XLA path assumes the engine's calls (a segment's tokens are its latest positions, consecutive),
# which every batch of make_batch is; it joins the tests whose batches are not edited by hand.
KERNELS = ["pallas-interpret", "native"]
# XLA's path is the slowest here on a CPU (compiling each batch: seconds a case, about an eighth of
# `make test-fast` for its cases here and in test_window_and_soft_cap.py): `heavy`, as the Pallas
# kernel in interpret mode is. test-fast still runs it through the model (tests/model/
# test_paged_attention.py, the batched == solo matrix's tiny-xla case).
XLA = pytest.param("xla", marks=pytest.mark.heavy)


def attend(impl, *args, sm_scale, block_sizes=BlockSizes()):
    if impl == "pallas-interpret":
        return ragged_paged_attention(*args, sm_scale=sm_scale, block_sizes=block_sizes, interpret=True)
    if impl == "native":
        require_native()
        return ragged_paged_attention_native(*args, sm_scale=sm_scale)
    assert impl == "xla"
    return ragged_paged_attention_xla(*args, sm_scale=sm_scale)


def make_batch(rng, *, page_size, num_heads, num_kv_heads, head_dim, seqs, dtype=jnp.float32, shuffle_tokens=False):
    """seqs: [(kv_len, num_new_tokens)]: each sequence's last `num_new_tokens` tokens are queries.
    Pages are drawn from a shuffled pool, and two padding tokens are appended."""
    max_pages = max(-(-kv_len // page_size) for kv_len, _ in seqs) + 1
    num_pages = len(seqs) * max_pages + 3
    pool = rng.permutation(num_pages)
    tables = np.zeros((len(seqs), max_pages), np.int32)
    segment_ids, positions = [], []
    for s, (kv_len, new) in enumerate(seqs):
        used = -(-kv_len // page_size)
        tables[s, :used] = pool[s * max_pages: s * max_pages + used]
        segment_ids += [s] * new
        positions += list(range(kv_len - new, kv_len))
    segment_ids += [len(seqs), len(seqs)]  # padding: out of range
    positions += [0, 0]
    segment_ids, positions = np.array(segment_ids, np.int32), np.array(positions, np.int32)
    if shuffle_tokens:
        order = rng.permutation(len(segment_ids))
        segment_ids, positions = segment_ids[order], positions[order]
    q = rng.normal(size=(len(segment_ids), num_heads, head_dim))
    k = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    v = rng.normal(size=(num_pages, page_size, num_kv_heads, head_dim))
    kv_lens = np.array([kv_len for kv_len, _ in seqs], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(segment_ids),
            jnp.asarray(positions), jnp.asarray(tables), jnp.asarray(kv_lens))


def check(args, *, tolerance, impl="pallas-interpret", block_sizes=BlockSizes()):
    scale = 1.0 / np.sqrt(args[0].shape[-1])
    got = attend(impl, *args, sm_scale=scale, block_sizes=block_sizes)
    want = ragged_paged_attention_reference(*args, sm_scale=scale)
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.all(np.isfinite(got))
    padding = np.asarray(args[3]) >= args[5].shape[0]
    assert np.all(got[padding] == 0)
    np.testing.assert_allclose(got, want, atol=tolerance, rtol=tolerance)


def lengths(page):
    """1, page-1, page, page+1 and long, each as decode (1 new token) and as prefill (all new)."""
    return [1, page - 1, page, page + 1, 5 * page + 3]


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("impl", KERNELS)
def test_mixed_batch_matches_reference(page_size, num_heads, num_kv_heads, head_dim, impl):
    rng = np.random.default_rng(page_size * 1000 + num_heads * 10 + head_dim)
    decodes = [(n, 1) for n in lengths(page_size)]
    prefills = [(n, n) for n in lengths(page_size)]
    chunk = [(3 * page_size + 2, page_size + 1)]  # a chunk continuing after cached context
    args = make_batch(rng, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      seqs=decodes + prefills + chunk)
    check(args, tolerance=1e-5, impl=impl)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("impl", KERNELS + [XLA])
def test_decode_only_and_prefill_only(kind, impl):
    rng = np.random.default_rng(1)
    seqs = [(n, 1 if kind == "decode" else n) for n in [1, 15, 16, 17, 70, 3]]
    args = make_batch(rng, page_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seqs=seqs)
    check(args, tolerance=1e-5, impl=impl)


# (One case per implementation and block size, so the interpreted Pallas ones are `heavy`.)
@pytest.mark.parametrize("impl, block_q", [("pallas-interpret", 1), ("pallas-interpret", 4), ("pallas-interpret", 32),
                                           ("native", None)])
def test_tokens_in_any_order_and_other_block_sizes(impl, block_q):
    rng = np.random.default_rng(2)
    seqs = [(20, 1), (9, 9), (33, 4), (1, 1)]
    args = make_batch(rng, page_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seqs=seqs, shuffle_tokens=True)
    block_sizes = BlockSizes() if block_q is None else BlockSizes(block_q=block_q)
    check(args, tolerance=1e-5, impl=impl, block_sizes=block_sizes)


@pytest.mark.parametrize("impl", KERNELS)
def test_bfloat16_within_a_looser_tolerance(impl):
    """bf16 inputs, f32 accumulation: errors of a few bf16 ulps (2^-8 relative) on outputs of O(1)."""
    rng = np.random.default_rng(3)
    seqs = [(n, 1) for n in lengths(16)] + [(40, 40), (50, 7)]
    args = make_batch(rng, page_size=16, num_heads=8, num_kv_heads=2, head_dim=64, seqs=seqs, dtype=jnp.bfloat16)
    check(args, tolerance=3e-2, impl=impl)


def test_native_bfloat16_pages_with_float32_queries():
    """bf16 pages widen to f32 exactly and the math is f32, so f32 queries keep the f32 tolerance."""
    rng = np.random.default_rng(6)
    seqs = [(n, 1) for n in lengths(16)] + [(40, 40), (50, 7)]
    q, k, v, *rest = make_batch(rng, page_size=16, num_heads=9, num_kv_heads=3, head_dim=128, seqs=seqs)
    check((q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), *rest), tolerance=1e-5, impl="native")


@pytest.mark.parametrize("impl", KERNELS)
def test_fully_masked_blocks_give_no_nan(impl):
    """Regression for the -inf mask trap: a query block whose rows see no key in a whole page
    (the page lies beyond their positions, or belongs to a segment they do not see), and a row with
    no key at all, must give finite outputs (zeros for the empty row)."""
    rng = np.random.default_rng(4)
    q, k, v, seg, pos, tables, lens = make_batch(rng, page_size=8, num_heads=2, num_kv_heads=1, head_dim=64,
                                                 seqs=[(40, 1), (40, 1)])
    # Token 0 sits at position 3 of a 40-token segment: pages 1..4 lie beyond it. Token 1's kv_len
    # is 0: it sees nothing at all.
    pos = pos.at[0].set(3)
    lens = lens.at[1].set(0)
    scale = 0.125
    got = np.asarray(attend(impl, q, k, v, seg, pos, tables, lens, sm_scale=scale))
    assert np.all(np.isfinite(got))
    assert np.all(got[1] == 0)
    want = np.asarray(ragged_paged_attention_reference(q, k, v, seg, pos, tables, lens, sm_scale=scale))
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("change, message", [
    (lambda a: {**a, "q": a["q"][0]}, "q must be"),
    (lambda a: {**a, "k_pages": a["k_pages"][..., :32]}, "head dim"),
    (lambda a: {**a, "segment_ids": a["segment_ids"][:-1]}, "segment_ids and positions"),
    (lambda a: {**a, "kv_lens": a["kv_lens"].astype(jnp.float32)}, "kv_lens must be integers"),
    (lambda a: {**a, "q": jnp.zeros((a["q"].shape[0], 3, 64))}, "multiple of KV heads"),
])
@pytest.mark.parametrize("impl", KERNELS)
def test_bad_inputs_are_named(change, message, impl):
    rng = np.random.default_rng(5)
    names = ["q", "k_pages", "v_pages", "segment_ids", "positions", "block_tables", "kv_lens"]
    args = dict(zip(names, make_batch(rng, page_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seqs=[(5, 1)])))
    bad = change(args)
    if "k_pages" in message or "head dim" in message:
        bad["v_pages"] = bad["k_pages"]
    with pytest.raises(ValueError, match=message):
        attend(impl, *[bad[n] for n in names], sm_scale=0.1)


@pytest.mark.parametrize("name", ["q", "k_pages"])
def test_native_refuses_other_dtypes_naming_the_argument(name):
    rng = np.random.default_rng(7)
    names = ["q", "k_pages", "v_pages", "segment_ids", "positions", "block_tables", "kv_lens"]
    args = dict(zip(names, make_batch(rng, page_size=8, num_heads=4, num_kv_heads=2, head_dim=64, seqs=[(5, 1)])))
    args[name] = args[name].astype(jnp.float16)
    if name == "k_pages":
        args["v_pages"] = args["k_pages"]
    with pytest.raises(ValueError, match=f"{name} must be float32 or bfloat16"):
        ragged_paged_attention_native(*[args[n] for n in names], sm_scale=0.1)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2)])
def test_native_decode_token_alone_equals_the_same_token_among_many(num_heads, num_kv_heads):
    """A decode token alone in a call is split by query head over several items (the threads would
    otherwise idle); among enough others it is one item of all its heads. Each row's arithmetic is
    the same either way: the bits must be too (batched == solo)."""
    require_native()
    rng = np.random.default_rng(11)
    shape = dict(page_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64)
    seqs = [(150, 1)] + [(40 + 9 * s, 1) for s in range(7)]
    q, k, v, segment_ids, positions, tables, kv_lens = make_batch(rng, **shape, seqs=seqs)
    many = np.asarray(ragged_paged_attention_native(q, k, v, segment_ids, positions, tables, kv_lens,
                                                    sm_scale=0.125))
    # The first sequence alone: its token, its table row, its length (the pages are the same arrays).
    alone = np.asarray(ragged_paged_attention_native(q[:1], k, v, segment_ids[:1], positions[:1], tables[:1],
                                                     kv_lens[:1], sm_scale=0.125))
    want = ragged_paged_attention_reference(q[:1], k, v, segment_ids[:1], positions[:1], tables[:1], kv_lens[:1],
                                            sm_scale=0.125)
    np.testing.assert_allclose(alone, np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(alone[0], many[0])
