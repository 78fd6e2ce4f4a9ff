"""Properties of the decoder on the ragged token axis, for both families (random init)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.config import load_model_preset
from orca_jax.model import LOGICAL_AXES
from orca_jax.model.decoder import init_decoder

FAMILIES = ["tiny", "tiny-gpt"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return init_decoder(load_model_preset(request.param), seed=1)


@nnx.jit
def forward(model, ids, positions, segments, logits_index):
    return model(ids, positions, segments, logits_index)


def run(model, ids, positions=None, segments=None, logits_index=None):
    """Jitted: one compile per shape is much faster on CPU than running the layers eagerly."""
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.arange(len(ids)) if positions is None else jnp.asarray(positions, jnp.int32)
    segments = jnp.zeros(len(ids), jnp.int32) if segments is None else jnp.asarray(segments, jnp.int32)
    return np.asarray(forward(model, ids, positions, segments, logits_index))


def random_ids(model, n, seed):
    return np.random.default_rng(seed).integers(0, model.config.vocab_size, n)


def test_causality(model):
    ids = random_ids(model, 20, 0)
    changed = ids.copy()
    changed[12:] = (changed[12:] + 7) % model.config.vocab_size
    a, b = run(model, ids), run(model, changed)
    np.testing.assert_array_equal(a[:12], b[:12])
    assert np.abs(a[12:] - b[12:]).max() > 1e-3  # and later tokens do see the change


def test_segment_isolation(model):
    """Two sequences on one axis give exactly the logits each gives alone."""
    first, second = random_ids(model, 11, 1), random_ids(model, 7, 2)
    alone_first, alone_second = run(model, first), run(model, second)
    packed = run(
        model,
        np.concatenate([first, second]),
        positions=np.concatenate([np.arange(11), np.arange(7)]),
        segments=[0] * 11 + [1] * 7,
    )
    np.testing.assert_allclose(packed[:11], alone_first, rtol=0, atol=1e-5)
    np.testing.assert_allclose(packed[11:], alone_second, rtol=0, atol=1e-5)


def test_interleaved_segments_and_padding(model):
    """Tokens of two sequences interleaved on the axis, plus padding in its own segment."""
    first, second = random_ids(model, 6, 3), random_ids(model, 6, 4)
    ids = np.stack([first, second], axis=1).reshape(-1)
    ids = np.concatenate([ids, [0, 0, 0]])
    positions = np.concatenate([np.repeat(np.arange(6), 2), [0, 0, 0]])
    segments = np.concatenate([np.tile([5, 2], 6), [99, 99, 99]])
    out = run(model, ids, positions, segments)
    np.testing.assert_allclose(out[0:12:2], run(model, first), atol=1e-5)
    np.testing.assert_allclose(out[1:12:2], run(model, second), atol=1e-5)


def test_logits_index_selects_rows(model):
    ids = random_ids(model, 9, 5)
    full = run(model, ids)
    picked = run(model, ids, logits_index=jnp.array([8, 2]))
    np.testing.assert_allclose(picked, full[[8, 2]], atol=1e-5)


def test_parameter_count_and_logical_axes(model):
    state = nnx.state(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(state)) == model.config.num_params()
    specs = jax.tree.leaves(nnx.get_partition_spec(state), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    names = {axis for spec in specs for axis in spec}
    assert names and names <= set(LOGICAL_AXES)


def test_rope_depends_only_on_relative_position():
    """Shifting every position of a sequence by a constant leaves llama logits unchanged (RoPE),
    and changes gpt2 logits (learned absolute positions)."""
    for name, invariant in (("tiny", True), ("tiny-gpt", False)):
        model = init_decoder(load_model_preset(name), seed=2)
        ids = random_ids(model, 10, 6)
        base, shifted = run(model, ids), run(model, ids, positions=np.arange(10) + 37)
        if invariant:
            np.testing.assert_allclose(base, shifted, atol=2e-4)
        else:
            assert np.abs(base - shifted).max() > 1e-3
