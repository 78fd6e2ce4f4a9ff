"""The model with the paged KV cache (XLA and native attention) against the full-sequence forward pass."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.config import load_model_preset
from orca_jax.model import AttentionMetadata
from orca_jax.model.attention import KVCache
from orca_jax.model.decoder import init_decoder
from orca_jax.model.paged_attention import ATTENTION_BACKENDS, paged_attention

from ..conftest import require_native

PAGE = 4
IMPLS = ["xla", "native"]


@functools.partial(nnx.jit, static_argnames="impl")
def paged_forward(model, token_ids, meta, kv, impl):
    return model.forward(token_ids, meta, kv, attention=functools.partial(paged_attention, impl=impl))


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt"])
@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_paged_forward_equals_full_forward(preset, impl):
    """Two sequences fed in uneven chunks (prefill pieces, then single decode tokens) on shuffled
    pages give the logits of one full-sequence pass each."""
    if impl == "native":
        require_native()
    config = load_model_preset(preset)
    model = init_decoder(config, seed=7)
    rng = np.random.default_rng(0)
    lengths = [23, 9]
    seqs = [rng.integers(0, config.vocab_size, n) for n in lengths]
    full = [np.asarray(model(jnp.asarray(s), jnp.arange(len(s)), jnp.zeros(len(s), jnp.int32))) for s in seqs]

    num_pages = 16
    tables = np.array(rng.permutation(num_pages)[:16].reshape(2, 8), np.int32)  # shuffled pages
    kv_shape = (num_pages + 1, PAGE, config.n_kv_heads, config.head_dim)
    kv = KVCache.zeros(config.n_layers, kv_shape, jnp.float32)  # every layer's pages in two arrays
    # Per step: tokens to compute for each sequence (0 = not in this step).
    schedule = [(5, 9), (7, 0), (4, 0), (1, 0), (1, 0), (5, 0)]
    done = [0, 0]
    T = 16
    for step in schedule:
        ids, pos, seg, slots = [], [], [], []
        for s, n in enumerate(step):
            p = np.arange(done[s], done[s] + n)
            ids += list(seqs[s][p]); pos += list(p); seg += [s] * n
            slots += list(tables[s][p // PAGE] * PAGE + p % PAGE)
        n_real = len(ids)
        pad = T - n_real
        meta = AttentionMetadata(
            positions=jnp.array(pos + [0] * pad, jnp.int32),
            segment_ids=jnp.array(seg + [2] * pad, jnp.int32),
            slot_mapping=jnp.array(slots + [num_pages * PAGE] * pad, jnp.int32),
            block_tables=jnp.asarray(tables),
            kv_lens=jnp.array([done[0] + step[0], done[1] + step[1]], jnp.int32),
        )
        logits, kv = paged_forward(model, jnp.array(ids + [0] * pad, jnp.int32), meta, kv, impl)
        logits = np.asarray(logits)
        t = 0
        for s, n in enumerate(step):
            np.testing.assert_allclose(logits[t:t + n], full[s][done[s]:done[s] + n], atol=2e-5, rtol=1e-5)
            t += n
            done[s] += n
        assert np.all(np.isfinite(logits[n_real:]))  # padding rows: no NaN
    assert done == lengths


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_tokens_give_zeros_and_no_nan(impl):
    if impl == "native":
        require_native()
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(6, 4, 8)), jnp.float32)
    pages = jnp.asarray(rng.normal(size=(5, PAGE, 2, 8)), jnp.float32)
    out = ATTENTION_BACKENDS[impl].attend(
        q, pages, pages, segment_ids=jnp.array([0, 0, 1, 1, 1, 1]), positions=jnp.array([3, 4, 0, 0, 0, 0]),
        block_tables=jnp.array([[2, 0]]), kv_lens=jnp.array([5]), sm_scale=0.3)
    out = np.asarray(out)
    assert np.all(np.isfinite(out))
    assert np.all(out[2:] == 0)
    assert np.abs(out[:2]).max() > 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_native_write_equals_xla_write_in_place(dtype):
    """The native kernel's K/V write (used with impl native: XLA:CPU's scatter into bf16 pages
    converts the whole array) writes what write_kv writes, skips slots outside the cache, and
    updates the donated pages in place."""
    require_native()
    import jax

    from orca_jax.model.paged_attention import write_kv
    from pallas_kernels.native import write_kv_native

    rng = np.random.default_rng(0)
    pages = [jnp.asarray(rng.normal(size=(7, 4, 3, 8)), dtype) for _ in range(2)]
    k, v = (jnp.asarray(rng.normal(size=(5, 3, 8)), jnp.float32) for _ in range(2))
    slots = jnp.array([0, 9, 27, 7 * 4 + 2, 13], jnp.int32)  # the fourth lies outside the cache
    want = write_kv(*pages, k, v, slots)
    got = jax.jit(write_kv_native, donate_argnums=(0, 1))(*[p.copy() for p in pages], k, v, slots)
    for g, w, before in zip(got, want, pages):
        assert g.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        assert not np.array_equal(np.asarray(g, np.float32), np.asarray(before, np.float32))


def test_native_write_and_attention_keep_to_the_layers_pages():
    """With `pages` (a layer's range in arrays holding every layer's), the native write puts slot s
    at the range's slot s, skips slots past the range, and the attention reads the range's pages:
    what the whole-array calls give on the range alone."""
    require_native()
    import jax

    from orca_jax.model.paged_attention import write_kv
    from pallas_kernels.native import ragged_paged_attention_native, write_kv_native

    rng = np.random.default_rng(2)
    first, count = 3, 4
    pages = [jnp.asarray(rng.normal(size=(9, PAGE, 2, 8)), jnp.float32) for _ in range(2)]
    k, v = (jnp.asarray(rng.normal(size=(4, 2, 8)), jnp.float32) for _ in range(2))
    slots = jnp.array([0, 5, count * PAGE + 1, 15], jnp.int32)  # the third lies past the layer's pages
    got = jax.jit(functools.partial(write_kv_native, pages=(first, count)))(*pages, k, v, slots)
    layer = [p[first:first + count] for p in pages]
    want = write_kv(*layer, k, v, slots)
    for g, w, whole in zip(got, want, pages):
        np.testing.assert_array_equal(np.asarray(g[first:first + count]), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(g[:first]), np.asarray(whole[:first]))  # others untouched
        np.testing.assert_array_equal(np.asarray(g[first + count:]), np.asarray(whole[first + count:]))
    q = jnp.asarray(rng.normal(size=(2, 4, 8)), jnp.float32)
    args = dict(segment_ids=jnp.array([0, 0]), positions=jnp.array([5, 6]), block_tables=jnp.array([[2, 0]]),
                kv_lens=jnp.array([7]), sm_scale=0.3)
    out = ragged_paged_attention_native(q, *got, **args, pages=(first, count))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ragged_paged_attention_native(q, *want, **args)))


def test_a_cache_splits_its_layers_over_arrays_that_kernels_can_index(monkeypatch):
    """Layers share an array as far as MAX_KV_ARRAY_ELEMENTS allows (32-bit offsets in kernels), and
    the model runs the same over any split: 5 layers of 120-element pages under a limit of 2.5
    layers' elements make arrays of 2, 2 and 1 layers whose paged forward equals the one-array cache's."""
    import dataclasses

    from orca_jax.model import attention

    config = dataclasses.replace(load_model_preset("tiny"), n_layers=5)
    model = init_decoder(config, seed=3)
    layer_shape = (3, PAGE, config.n_kv_heads, config.head_dim)
    one = KVCache.zeros(config.n_layers, layer_shape, jnp.float32)
    assert len(one.k) == 1 and one.num_layers == config.n_layers
    layer_elements = int(np.prod(layer_shape))
    monkeypatch.setattr(attention, "MAX_KV_ARRAY_ELEMENTS", 2 * layer_elements + layer_elements // 2)
    split = KVCache.zeros(config.n_layers, layer_shape, jnp.float32)
    per_array = [a.shape[0] // 3 for a in split.k]
    assert per_array == [2, 2, 1]
    meta = AttentionMetadata(positions=jnp.arange(5, dtype=jnp.int32), segment_ids=jnp.zeros(5, jnp.int32),
                             slot_mapping=jnp.array([4, 5, 6, 7, 8], jnp.int32), block_tables=jnp.array([[1, 2]]),
                             kv_lens=jnp.array([5], jnp.int32))
    ids = jnp.array([3, 1, 4, 1, 5], jnp.int32)
    want, kv_one = paged_forward(model, ids, meta, one, "xla")
    got, kv_split = paged_forward(model, ids, meta, split, "xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for layer in range(config.n_layers):
        for a, b in zip(kv_split.layer(layer), kv_one.layer(layer)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
