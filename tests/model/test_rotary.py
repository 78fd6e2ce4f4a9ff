"""The GGUF Q/K row permutation and our half-split RoPE agree with llama.cpp's interleaved RoPE."""

import numpy as np

from orca_jax.checkpoint.gguf_import import unpermute_llama_qk
from orca_jax.model.rotary import apply_rope


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
