"""`--load-format dummy`: seeded random weights of a model's shapes, made on the devices.

For trying a layout (and benchmarking it) before downloading the weights, as vLLM's dummy format.
Each parameter is drawn from a key of its own (the seed folded with the parameter's name in the
whole model, e.g. `layers.17.attn.q.kernel`), by a jitted function whose output carries the
parameter's sharding: each device computes only its own shard (jax's partitionable threefry makes
the values independent of the sharding), and nothing of the size of the model is ever on the host.
So a dummy model's weights, and its greedy tokens, are the same whatever the tp / pp layout or the
number of processes.

Scales keep a random model numerically tame and its greedy choices clear: matrices ~ N(0, 1/fan_in)
(activations stay O(1) through the layers), embeddings ~ N(0, 1/d) (with N(0, 1), a tied head sees
each token's own embedding dominate the residual stream, and the random model just repeats its last
token), norm scales 1, biases 0. Logits then spread by ~1, so the top token leads the next by far
more than float rounding, and layouts that add in another order still agree.
"""

from __future__ import annotations

import math
import zlib

import dataclasses
import functools

import jax
import jax.numpy as jnp

from orca_jax.checkpoint.store import stage_parameter_name


def _scale(name: str, shape: tuple[int, ...]) -> float | None:
    """The standard deviation of a parameter's draw; None for norm scales (ones) and biases (zeros)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("scale", "bias"):
        return None
    if leaf == "embedding":  # [V, D]
        return 1.0 / math.sqrt(shape[1])
    # kernels: [D, H, Dh] for q/k/v, [H, Dh, D] for o, [D, F] / [F, D] for the MLP
    fan_in = math.prod(shape[:2]) if name.endswith("attn.o.kernel") else shape[0]
    return 1.0 / math.sqrt(fan_in)


@functools.lru_cache(maxsize=None)
def _draw_program(shape: tuple[int, ...], dtype, std: float | None, fill: float, sharding):
    """One program per kind of parameter (the layers share them): key -> the sharded array."""
    def draw(key):
        if std is None:
            return jnp.full(shape, fill, dtype)
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    return jax.jit(draw, out_shardings=sharding)


@dataclasses.dataclass(frozen=True)
class DummyWeights:
    """A stage's parameters as seeded random weights, each array computed where its sharding puts it."""

    seed: int

    def describe(self) -> str:
        return f"dummy, seed {self.seed}"

    def summary(self) -> str:
        return f"RANDOM (dummy, seed {self.seed}), made on the devices"

    def stage_params(self, abstract_state, shardings, *, layers: range, tied: bool):
        """One parameter at a time, so the memory a draw needs beside the weights is one
        parameter's random bits, not the model's."""
        names = jax.tree_util.tree_map_with_path(lambda p, _: stage_parameter_name(p, layers, tied), abstract_state)
        base = jax.random.key(self.seed)

        def make(name: str, spec, sharding):
            fill = 1.0 if name.endswith(".scale") else 0.0
            program = _draw_program(tuple(spec.shape), jnp.dtype(spec.dtype), _scale(name, spec.shape), fill, sharding)
            return program(jax.random.fold_in(base, zlib.crc32(name.encode())))

        return jax.tree.map(make, names, abstract_state, shardings)
