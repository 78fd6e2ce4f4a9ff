"""The GGUF Q/K row permutation and our half-split RoPE agree with llama.cpp's interleaved RoPE; the
host's cos and sin tables agree with the program's, and each layer rotates with its own kind's."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.checkpoint.gguf_import import unpermute_llama_qk
from orca_jax.config import load_model_preset
from orca_jax.model.attention import AttentionMetadata
from orca_jax.model.decoder import init_decoder
from orca_jax.model.rotary import HostRotations, Llama3Scaling, Rotary, apply_rope, rope_inv_freq, rotation_tables


def interleaved_rope(x, positions, theta):
    """llama.cpp's layout: pairs are adjacent elements (x[2i], x[2i+1])."""
    dh = x.shape[-1]
    inv_freq = theta ** (-np.arange(0, dh, 2) / dh)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


def permute_like_llama_cpp(weight, num_heads):
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(unpermute_llama_qk(permute_like_llama_cpp(w, 3), 3), w)


def test_half_split_rope_on_hf_rows_equals_interleaved_rope_on_gguf_rows():
    rng = np.random.default_rng(1)
    heads, dh, d, t = 3, 8, 5, 6
    w_hf = rng.normal(size=(heads * dh, d)).astype(np.float32)
    x = rng.normal(size=(t, d)).astype(np.float32)
    positions = np.arange(t) * 3
    ours = np.asarray(apply_rope((x @ w_hf.T).reshape(t, heads, dh), positions, 10000.0))
    w_gguf = permute_like_llama_cpp(w_hf, heads)
    theirs = interleaved_rope((x @ w_gguf.T).reshape(t, heads, dh), positions, 10000.0)
    # Same rotation, different order of the elements inside a head: compare after undoing it.
    theirs_unpermuted = unpermute_llama_qk(theirs.reshape(t, heads * dh).T, heads).T.reshape(t, heads, dh)
    np.testing.assert_allclose(ours, theirs_unpermuted, atol=1e-5)


def llama3_inv_freq_reference(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len):
    """HF transformers' `_compute_llama3_parameters`, branch by branch, in float64 numpy."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled), wavelen, (high_freq_wavelen, low_freq_wavelen)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, original", [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),   # Llama 3.1 8B
    (64, 500000.0, 32.0, 1.0, 4.0, 8192),   # Llama 3.2 1B
    (16, 10000.0, 8.0, 1.0, 4.0, 64),       # the tiny model of the import test
])
def test_llama3_frequencies_match_the_reference(head_dim, theta, factor, low, high, original):
    want, wavelen, (short, long) = llama3_inv_freq_reference(head_dim, theta, factor, low, high, original)
    # Every regime is exercised: kept, blended and fully scaled frequencies.
    assert (wavelen < short).any() and ((wavelen >= short) & (wavelen <= long)).any() and (wavelen > long).any()
    got = np.asarray(rope_inv_freq(head_dim, theta, Llama3Scaling(factor, low, high, original)))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    np.testing.assert_allclose(np.asarray(rope_inv_freq(head_dim, theta)), 1.0 / theta ** (np.arange(0, head_dim, 2)
                                                                                          / head_dim), rtol=2e-6)


def test_scaled_rope_rotates_by_the_reference_frequencies():
    rng = np.random.default_rng(2)
    t, heads, dh = 5, 2, 16
    x = rng.normal(size=(t, heads, dh)).astype(np.float32)
    positions = np.array([0, 1, 100, 1000, 5000])
    inv_freq, _, _ = llama3_inv_freq_reference(dh, 10000.0, 8.0, 1.0, 4.0, 64)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    got = np.asarray(apply_rope(x, positions, 10000.0, Llama3Scaling(8.0, 1.0, 4.0, 64)))
    np.testing.assert_allclose(got, want, atol=2e-3)  # float32 angles at position 5000


# Sliding layers with their own base, full layers with Llama 3 scaling: two rotary kinds (Gemma 3's
# arrangement, with a scaling of another family to cover that branch too). The window spans every test
# position: masks stay the same when the test moves positions.
TWO_KINDS = dict(sliding_window=100, layer_types=("sliding", "full"), rope_local_theta=50.0, rope_scaling="llama3",
                 rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_position=16)


def test_the_hosts_tables_equal_the_programs_for_each_kind_of_a_model():
    config = dataclasses.replace(load_model_preset("tiny"), **TWO_KINDS)
    host = HostRotations(config)
    assert host.kinds == (Rotary(16, 50.0), Rotary(16, 10000.0, Llama3Scaling(8.0, 1.0, 4.0, 16)))
    positions = np.array([0, 1, 7, 127, 3, 5000], np.int32)
    tables = host(positions)
    for i, kind in enumerate(host.kinds):
        cos, sin = jax.jit(rotation_tables, static_argnums=0)(kind, jnp.asarray(positions))
        np.testing.assert_allclose(tables.cos[i], cos, rtol=0, atol=3e-7)
        np.testing.assert_allclose(tables.sin[i], sin, rtol=0, atol=3e-7)
    assert tables.of(Rotary(16, 123.0)) is None  # another model's kind (a draft model's): computed in its program


@nnx.jit
def logits(model, ids, meta):
    return model.forward(ids, meta, None)[0]


def test_each_layer_rotates_with_the_tables_of_its_own_kind():
    """The model's logits with the host's tables equal those computed from the positions; tables made for
    other positions give those positions' logits, so the layers read the tables, each its own kind's."""
    config = dataclasses.replace(load_model_preset("tiny"), **TWO_KINDS)
    model = init_decoder(config, seed=3)
    for layer in model.layers:  # sharper attention than random init's near-uniform one: the rotation shows
        layer.attn.q.kernel[...] = layer.attn.q.kernel[...] * 8
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, 6), jnp.int32)
    positions, segments = np.arange(6, dtype=np.int32), jnp.zeros(6, jnp.int32)
    host = HostRotations(config)

    def meta(at, rotations=None):
        return AttentionMetadata(positions=jnp.asarray(at), segment_ids=segments, rotations=rotations)

    computed = logits(model, ids, meta(positions))
    np.testing.assert_allclose(logits(model, ids, meta(positions, host(positions))), computed, atol=2e-5)
    spread = positions * 3  # the tables say the tokens sit 3 apart; the positions (masks) keep them 1 apart
    from_tables = logits(model, ids, meta(positions, host(spread)))
    np.testing.assert_allclose(from_tables, logits(model, ids, meta(spread)), atol=2e-5)
    assert np.abs(np.asarray(from_tables) - np.asarray(computed)).max() > 1e-2
    swapped = host(positions)
    swapped = dataclasses.replace(swapped, kinds=swapped.kinds[::-1])  # each layer given the other kind's
    assert np.abs(np.asarray(logits(model, ids, meta(positions, swapped))) - np.asarray(computed)).max() > 1e-2
