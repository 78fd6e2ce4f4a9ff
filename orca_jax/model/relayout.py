"""A model rebuilt with other linear methods: how a decoder's matrices change layout (quantized at
load, float32 rows for the native kernel) without changing a module after it is built. The new
model is constructed with its methods (linear.py), as shapes only, then given the old model's
arrays, except the ones that change."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from orca_jax.model.decoder import Decoder, abstract_decoder
from orca_jax.model.layers import Dense, Embed
from orca_jax.model.linear import LinearMethod


def matrices(module: nnx.Module) -> dict[str, Dense | Embed]:
    """Every Dense and Embed under `module` by path ("embed", "layers.3.mlp.down"), a shared one once."""
    return {_name(path): m for path, m in nnx.iter_graph(module) if isinstance(m, (Dense, Embed))}


def abstract_relayout(model: Decoder, methods: dict[str, LinearMethod]) -> Decoder:
    """`model`'s structure (shapes only) with the matrices named in `methods` taking those methods;
    the others keep theirs."""
    plan = {name: m.method for name, m in matrices(model).items()} | methods
    return abstract_decoder(model.config, linear=plan.__getitem__)


def relayout(model: Decoder, methods: dict[str, LinearMethod], arrays: dict[str, jax.Array]) -> Decoder:
    """A new decoder like `model` whose matrices named in `methods` take those methods, holding
    `arrays` for the parameters they name ("layers.3.mlp.down.kernel") and `model`'s own arrays for
    the others. `model` is left as it is."""
    graphdef, state = nnx.split(abstract_relayout(model, methods))
    return nnx.merge(graphdef, filled(state, nnx.state(model), arrays))


def filled(abstract: nnx.State, source: nnx.State, arrays: dict[str, Any]) -> nnx.State:
    """The state `abstract` (shapes) with each parameter's array: from `arrays` by name, else the one
    at the same path in `source`. A shape or dtype that differs from the abstract one is an error."""
    source_values = nnx.to_pure_dict(source)

    def value(path, spec):
        keys = tuple(key.key for key in path)
        name = _name(keys)
        array = arrays[name] if name in arrays else _at(source_values, keys)
        if (tuple(array.shape), array.dtype) != (tuple(spec.shape), spec.dtype):
            raise ValueError(f"{name}: {array.dtype}{list(array.shape)} where the new layout holds "
                             f"{spec.dtype}{list(spec.shape)}")
        return array

    state = nnx.clone(abstract)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(value, nnx.to_pure_dict(abstract)))
    return state


def array_at(values: dict, name: str):
    """The array of the parameter `name` ("layers.3.mlp.down.kernel") in `values` (nnx.to_pure_dict's)."""
    return _at(values, tuple(int(key) if key.isdigit() else key for key in name.split(".")))


def _at(tree: dict, keys: tuple):
    for key in keys:
        tree = tree[key]
    return tree


def _name(path: tuple) -> str:
    return ".".join(map(str, path))
