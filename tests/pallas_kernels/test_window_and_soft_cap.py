"""The contract's optional terms, sliding window and attention-logit soft cap, in every
implementation (Pallas in interpret mode, native C++ in each instruction-set variant the CPU has,
XLA) against the reference; and a windowed layer reads no page outside its window."""

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.model.paged_attention import ragged_paged_attention_xla
from pallas_kernels import native, ragged_paged_attention, ragged_paged_attention_reference

from ..conftest import require_native
from .test_ragged_paged_attention import XLA, make_batch

PAGE = 8


def attend(impl, *args, **options):
    if impl == "pallas-interpret":
        return ragged_paged_attention(*args, interpret=True, **options)
    if impl == "xla":
        return ragged_paged_attention_xla(*args, **options)
    require_native()
    native.select_isa(impl.removeprefix("native-"))
    return native.ragged_paged_attention_native(*args, **options)


def native_variants():
    try:
        require_native()
    except pytest.skip.Exception:
        return ["native-base"]
    return [f"native-{name}" for name in native.supported_isas()]


@pytest.fixture(autouse=True)
def restore_isa():
    chosen = native.isa() if native._loaded is not None else None
    yield
    if chosen is not None:
        native.select_isa(chosen)


# Windows shorter than a page, about a page, longer than some prompts, crossing pages; caps on and off.
@pytest.mark.parametrize("sliding_window, soft_cap", [(3, None), (PAGE + 1, None), (20, 5.0), (None, 2.0),
                                                      (1, 30.0)])
@pytest.mark.parametrize("impl", ["pallas-interpret", XLA, *native_variants()])
def test_window_and_cap_match_the_reference(impl, sliding_window, soft_cap):
    rng = np.random.default_rng(7)
    # Decodes at lengths around the page and the window, prefills shorter and longer than the
    # window, a chunk continuing after cached context.
    seqs = [(1, 1), (PAGE - 1, 1), (PAGE + 1, 1), (45, 1), (5, 5), (30, 30), (3 * PAGE + 2, PAGE + 1)]
    args = make_batch(rng, page_size=PAGE, num_heads=6, num_kv_heads=2, head_dim=64, seqs=seqs)
    args = (args[0] * 3.0, *args[1:])  # scores of several units, so the cap bends them
    options = dict(sm_scale=0.125, sliding_window=sliding_window, soft_cap=soft_cap)
    got = np.asarray(attend(impl, *args, **options))
    want = np.asarray(ragged_paged_attention_reference(*args, **options))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    # The terms matter on this batch: without them the reference differs.
    plain = np.asarray(ragged_paged_attention_reference(*args, sm_scale=0.125))
    assert np.abs(plain - want).max() > 1e-2


@pytest.mark.parametrize("impl", ["pallas-interpret", XLA, "native-" + native_variants()[0].split("-")[1]])
def test_a_windowed_layer_reads_no_page_before_its_window(impl):
    """Pages wholly before every query's window hold NaN: an implementation that read them (even
    to mask them: NaN x 0 is NaN) would give NaN. (The native kernel also skips, per chunk, rows that
    see none of its keys, so for it this checks that no masked value enters, not the page loop.)"""
    rng = np.random.default_rng(8)
    q, k, v, seg, pos, tables, lens = make_batch(rng, page_size=PAGE, num_heads=4, num_kv_heads=2, head_dim=64,
                                                 seqs=[(330, 1), (300, 3)])
    window = 20  # the earliest query sits at 297: keys from 278 on; the pages of tokens < 256 unseen
    options = dict(sm_scale=0.125, sliding_window=window)
    want = np.asarray(ragged_paged_attention_reference(q, k, v, seg, pos, tables, lens, **options))
    # (Table entries past a sequence's pages are 0: the XLA path reads, and masks, page 0 there.)
    unseen = np.setdiff1d(np.asarray(tables)[:, : 256 // PAGE], np.asarray(tables)[:, 256 // PAGE:])
    k = k.at[unseen].set(jnp.nan)
    v = v.at[unseen].set(jnp.nan)
    got = np.asarray(attend(impl, q, k, v, seg, pos, tables, lens, **options))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("options, message", [
    (dict(sliding_window=0), "sliding_window must be a positive int"),
    (dict(sliding_window=2.5), "sliding_window must be a positive int"),
    (dict(soft_cap=0.0), "soft_cap must be > 0"),
    (dict(soft_cap=-1.0), "soft_cap must be > 0"),
])
@pytest.mark.parametrize("impl", ["pallas-interpret", "native-base"])
def test_bad_options_are_named(impl, options, message):
    rng = np.random.default_rng(9)
    args = make_batch(rng, page_size=PAGE, num_heads=2, num_kv_heads=1, head_dim=64, seqs=[(5, 1)])
    with pytest.raises(ValueError, match=message):
        attend(impl, *args, sm_scale=0.125, **options)


def test_a_windowed_decode_reads_keys_in_proportion_to_the_window():
    """Counted by the native kernel: a decode at position 329 with a window of 20 reads 20 keys per
    KV head, not 330."""
    require_native()
    rng = np.random.default_rng(10)
    args = make_batch(rng, page_size=PAGE, num_heads=4, num_kv_heads=2, head_dim=64, seqs=[(330, 1)])

    def keys_read(**options):
        before = native.keys_read()
        np.asarray(native.ragged_paged_attention_native(*args, sm_scale=0.125, **options))
        return native.keys_read() - before

    assert keys_read() == 330 * 2
    assert keys_read(sliding_window=20) == 20 * 2
