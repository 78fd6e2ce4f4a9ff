"""One quantized matmul call of several matrices that share x (a layer's q, k and v; gate and up:
quantized_matmuls): each result must be, bit for bit, what a call of its matrix alone gives, in
every variant, with either activations, for matrices of formats whose int8 offsets differ (Q4_0 8,
Q6_K 32, Q4_1 0), and the layers must take the one call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.model.layers import Dense, dense_all
from orca_jax.model.linear import GGUFBlockLinear, Int8Linear
from pallas_kernels import native
from pallas_kernels import quantized_matmul as qm
from pallas_kernels.int8_activations import quantize_reference

from .test_int8_activations import random_weights, variant  # noqa: F401 (a fixture)

# Mixed as a Q4_K_M file mixes them, offsets differing, int8 rows with their scales; out sizes that
# leave a remainder of a work item (32 rows).
MATRICES = (("q4_1", 192), ("q6_k", 67), ("q4_0", 130), ("int8", 33), ("q4_k", 64))
IN = 768  # a multiple of a K-quant super-block


def matrices(rng, activations="int8"):
    """MATRICES' random weights; with float32 activations a float model's f32 rows too."""
    formats, weights, scales = [], [], []
    for format, out in MATRICES + ((("f32", 40),) if activations == "float32" else ()):
        w, s = (rng.standard_normal((out, IN)).astype(np.float32), None) if format == "f32" else \
            random_weights(format, out, IN, rng)
        formats.append(format)
        weights.append(jnp.asarray(w))
        scales.append(None if s is None else jnp.asarray(s))
    return tuple(formats), tuple(weights), tuple(scales)


together = jax.jit(qm.quantized_matmuls_native, static_argnames=("formats", "activations"))
alone = jax.jit(qm.quantized_matmul_native, static_argnames=("format", "activations"))


@pytest.mark.parametrize("activations", qm.ACTIVATIONS)
def test_one_call_of_several_matrices_gives_each_matrix_its_own_bits(variant, activations):  # noqa: F811
    rng = np.random.default_rng(3)
    formats, weights, scales = matrices(rng, activations)
    for tokens, real in ((1, 1), (2, 2), (5, 3), (16, 16), (64, 64)):
        x = (rng.standard_normal((tokens, IN)) * rng.uniform(0.1, 10, (tokens, 1))).astype(np.float32)
        got = together(x, formats=formats, weights=weights, scales=scales, num_rows=real, activations=activations)
        for i, format in enumerate(formats):
            want = alone(x, format=format, weights=weights[i], scales=scales[i], num_rows=real, activations=activations)
            np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(want),
                                          err_msg=f"{format} {variant} {activations} T={tokens} real={real}")


def test_xla_path_of_several_matrices_equals_each_alone():
    """Off the native kernel (GPU, large calls) each matrix is its own dot of the once-quantized x:
    each result is the numpy reference's for its matrix alone, given x quantized and dequantized by
    int8_activations' rule, to XLA's f32 summation order (unquantized x would be off by ~1e-2)."""
    rng = np.random.default_rng(4)
    formats, weights, scales = matrices(rng)
    x = rng.standard_normal((3, IN)).astype(np.float32)
    got = qm.quantized_matmuls(x, formats, weights, scales, cpu_native=False, activations="int8")
    q, d = quantize_reference(x)
    quantized_x = (q * d[..., None]).reshape(x.shape)
    for i, format in enumerate(formats):
        want = qm.quantized_matmul_reference(quantized_x, format, np.asarray(weights[i]),
                                             None if scales[i] is None else np.asarray(scales[i]))
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=format)


def dense(method, out: int, seed: int, in_shape: tuple[int, ...] = (IN,)) -> Dense:
    from flax import nnx

    layer = Dense(in_shape, (out,), ("heads", "head_dim")[-len(in_shape):], ("mlp",), use_bias=True,
                  dtype=jnp.float32, rngs=nnx.Rngs(seed), method=method)
    rng = np.random.default_rng(seed)
    weights, scales = random_weights(method.format, out, IN, rng)
    layer.kernel.value = jnp.asarray(weights)
    if scales is not None:
        layer.scales.value = jnp.asarray(scales)
    layer.bias.value = jnp.asarray(rng.standard_normal(out).astype(np.float32))
    return layer


def test_denses_of_one_input_take_one_native_call_and_their_own_results():
    from ..conftest import require_native

    require_native()
    layers = [dense(GGUFBlockLinear("Q4_1", cpu_native=True, activations="int8"), 192, 0),
              dense(GGUFBlockLinear("Q6_K", cpu_native=True, activations="int8"), 64, 1),
              dense(Int8Linear(cpu_native=True, activations="int8"), 96, 2)]
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, IN)).astype(np.float32))
    shared = jax.jit(lambda x: dense_all(layers, x, jnp.int32(2)))
    calls = shared.lower(x).as_text().count(native.MATMUL_TARGET)
    assert calls == 1, f"{calls} native matmul calls for three matrices of one x"
    for layer, got in zip(layers, shared(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda x: layer(x, jnp.int32(2)))(x)))
    # Methods that take x differently do not share a call.
    mixed = layers[:1] + [dense(GGUFBlockLinear("Q4_1", cpu_native=True, activations="float32"), 32, 3)]
    assert jax.jit(lambda x: dense_all(mixed, x)).lower(x).as_text().count(native.MATMUL_TARGET) == 2


def test_denses_contracting_several_axes_each_take_their_own_call():
    """An output projection's x is [T, H, Dh]: the shared call, which contracts x's last axis, is not
    for it; each Dense multiplies as it does alone."""
    from ..conftest import require_native

    require_native()
    layers = [dense(GGUFBlockLinear("Q4_1", cpu_native=True, activations="int8"), 32, seed, (4, IN // 4))
              for seed in (6, 7)]
    x = jnp.asarray(np.random.default_rng(8).standard_normal((2, 4, IN // 4)).astype(np.float32))
    for layer, got in zip(layers, jax.jit(lambda x: dense_all(layers, x))(x)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(layer)(x)))
