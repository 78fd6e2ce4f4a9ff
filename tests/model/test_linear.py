"""Linear methods (model/linear.py): each matrix gets its method when the decoder is built, by its
path, and a model in another layout is a new model (model/relayout.py) that leaves the old one as
it was. The quantized and float-row models' numbers are tested against float32 elsewhere
(test_quantization.py, tests/runner/test_matmul_impl.py); these check the plumbing on the tiny preset."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from orca_jax.config import load_model_preset
from orca_jax.model.decoder import init_decoder
from orca_jax.model.layers import Dense
from orca_jax.model.linear import FloatLinear, FloatRowsLinear, GGUFBlockLinear, Int8Linear
from orca_jax.model.relayout import matrices, relayout

from ..conftest import require_native

CONFIG = load_model_preset("tiny")  # d_model 64, d_ff 128: every matrix is whole 32-wide blocks
ROWS = FloatRowsLinear(native_max_tokens=64)  # every call of the test below in the native kernel


@nnx.jit
def logits(model, ids):
    return model(ids, jnp.arange(len(ids)), jnp.zeros(len(ids), jnp.int32))


def test_each_matrix_is_built_with_the_method_its_path_names():
    require_native()
    wanted = {"layers.1.attn.q": ROWS, "layers.1.mlp.down": ROWS, "embed": ROWS}
    model = init_decoder(CONFIG, seed=3, linear=lambda path: wanted.get(path, FloatLinear()))
    got = {path: module.method for path, module in matrices(model).items()}
    assert {path: m for path, m in got.items() if m != FloatLinear()} == wanted
    down = model.layers[1].mlp.down.kernel[...]
    assert down.shape == (CONFIG.d_model, CONFIG.d_ff) and down.dtype == jnp.float32  # rows [out, in]
    # The same random draws in either layout: the float-rows model computes the float model's logits.
    ids = jnp.asarray([5, 9, 2, 40, 7], jnp.int32)
    np.testing.assert_allclose(logits(model, ids), logits(init_decoder(CONFIG, seed=3), ids), rtol=1e-5, atol=1e-5)


def test_relayout_makes_a_new_model_and_leaves_the_old_one_as_it_was():
    model = init_decoder(CONFIG, seed=4)
    float_down = model.layers[0].mlp.down.kernel[...]
    rows = np.zeros((CONFIG.d_model, CONFIG.d_ff), np.int8)
    scales = np.ones(CONFIG.d_model, np.float32)
    new = relayout(model, {"layers.0.mlp.down": Int8Linear(cpu_native=False)},
                   {"layers.0.mlp.down.kernel": jnp.asarray(rows), "layers.0.mlp.down.scales": jnp.asarray(scales)})
    assert new.layers[0].mlp.down.method == Int8Linear(cpu_native=False)
    assert new.layers[0].mlp.down.kernel[...].dtype == jnp.int8
    assert new.layers[1].mlp.down.kernel[...] is model.layers[1].mlp.down.kernel[...]  # the others are shared
    assert model.layers[0].mlp.down.method == FloatLinear()
    assert model.layers[0].mlp.down.kernel[...] is float_down
    assert isinstance(model.layers[0].mlp.down, Dense) and model.layers[0].mlp.down.scales is None


def test_an_array_that_does_not_fit_the_new_layout_is_refused_naming_it():
    model = init_decoder(CONFIG, seed=4)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down\.kernel: int8\[128, 64\] where the new layout "
                                         r"holds int8\[64, 128\]"):
        relayout(model, {"layers.0.mlp.down": Int8Linear(cpu_native=False)},
                 {"layers.0.mlp.down.kernel": jnp.zeros((CONFIG.d_ff, CONFIG.d_model), jnp.int8),
                  "layers.0.mlp.down.scales": jnp.ones(CONFIG.d_model, jnp.float32)})


def test_a_gguf_block_type_without_a_kernel_is_refused_naming_those_served():
    assert GGUFBlockLinear("Q4_1", cpu_native=False).format == "q4_1"
    with pytest.raises(ValueError, match="GGUF block type 'Q2_K' has no kernel; served in place: Q4_0, Q4_1, Q8_0, "
                                         "Q5_0, Q5_1, Q4_K, Q5_K, Q6_K"):
        GGUFBlockLinear("Q2_K", cpu_native=False)
