"""Each step ships its rotary cos and sin, computed on the host (rotary.HostRotations): the layers
program reads them and evaluates no cos or sin itself (XLA:CPU evaluated them in every layer's q and
k fusion, once per head)."""

import numpy as np

from orca_jax.engine.step_plan import padding_plan
from orca_jax.runner.programs import lower


def test_the_layers_program_reads_the_steps_cos_and_sin_and_computes_none(tiny_runner):
    runner, stage = tiny_runner, tiny_runner.stages[0]
    plan = padding_plan(runner.buckets.tokens[0], runner.buckets.row_buckets[0], runner.kv_layout,
                        runner.config.vocab_size)
    plan.positions[:] = np.arange(len(plan.positions)) * 5  # other angles than padding's zeros
    inputs = runner.layers_inputs(plan)
    rotations = inputs.unpack().attention.rotations
    head_dim, theta = runner.config.head_dim, runner.config.rope_theta
    angles = plan.positions[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)
    np.testing.assert_allclose(rotations.cos[0], np.cos(angles), atol=1e-5)
    np.testing.assert_allclose(rotations.sin[0], np.sin(angles), atol=1e-5)
    args = (stage.param_leaves, stage.kv_cache, stage.token_pages, None, inputs, stage.fed_tokens)
    program = lower(stage.layers_program, args, runner.matmul_precision).as_text()
    assert "stablehlo.cosine" not in program and "stablehlo.sine" not in program
