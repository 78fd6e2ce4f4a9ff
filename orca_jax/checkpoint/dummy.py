"""`--load-format dummy`: seeded random weights of a model's shapes, made on the devices.

For trying a layout (and benchmarking it) before downloading the weights, as vLLM's dummy format.
Each parameter is drawn from a key of its own (the seed folded with the parameter's name in the
whole model, e.g. `layers.17.attn.q.kernel`), inside a jitted function whose outputs carry the
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

import jax
import jax.numpy as jnp


def parameter_name(path: tuple, layers: range, tied: bool) -> str:
    """The parameter's name in the whole decoder, from its path in a DecoderStage's state (whose
    layers are numbered from 0 and whose LM head is `head`)."""
    parts = [str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path]
    if parts[-1] == "value":  # a tree path into an nnx.State ends at the Variable's `value`
        parts.pop()
    if parts[0] == "layers":
        parts[1] = str(layers[int(parts[1])])
    elif parts[0] == "head":
        parts[0] = "embed" if tied else "lm_head"
    return ".".join(parts)


def _draw(key, name: str, shape: tuple[int, ...], dtype) -> jax.Array:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "scale":
        return jnp.ones(shape, dtype)
    if leaf == "bias":
        return jnp.zeros(shape, dtype)
    if leaf == "embedding":  # [V, D]
        std = 1.0 / math.sqrt(shape[1])
    else:  # kernels: [D, H, Dh] for q/k/v, [H, Dh, D] for o, [D, F] / [F, D] for the MLP
        fan_in = math.prod(shape[:2]) if name.endswith("attn.o.kernel") else shape[0]
        std = 1.0 / math.sqrt(fan_in)
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dummy_params(abstract_state, shardings, *, layers: range, tied: bool, seed: int, transform=None):
    """A DecoderStage's state (shapes from `abstract_state`) filled with the dummy weights, each
    array placed by `shardings` and computed there. `transform` (e.g. KV heads repeated for a large
    tp) runs on the drawn state inside the same program, so the values never depend on the layout."""
    names = jax.tree_util.tree_map_with_path(lambda path, _: parameter_name(path, layers, tied), abstract_state)
    base = jax.random.key(seed)

    def make():
        drawn = jax.tree.map(
            lambda name, spec: _draw(jax.random.fold_in(base, zlib.crc32(name.encode())), name, spec.shape, spec.dtype),
            names, abstract_state)
        return drawn if transform is None else transform(drawn)

    return jax.jit(make, out_shardings=shardings)()
