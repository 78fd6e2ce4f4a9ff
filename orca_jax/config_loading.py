"""Reading configuration: `ConfigError`, the checks the configuration dataclasses validate their
fields with, and TOML files into those dataclasses (`from_dict`, `load_toml`). Files only fill the
dataclasses; a key the dataclass does not have is an error that names the key, the file and the
keys that are allowed (a typo must never be ignored). This module does not import jax.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value or file is wrong; the message says which and how to fix it."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def check_literal(obj: Any, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    require(value in allowed, f"{type(obj).__name__}.{name}={value!r}; choose one of {list(allowed)}")


def check_positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        require(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            f"{type(obj).__name__}.{name} must be a positive integer, got {value!r}",
        )


def from_dict(cls: type, data: dict[str, Any], source: str) -> Any:
    """Builds dataclass `cls` from `data`, recursing into nested dataclass fields.

    Raises ConfigError naming `source` for unknown keys, missing required keys and wrong types.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a table for {cls.__name__}, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {unknown} for {cls.__name__}; allowed keys are {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = _optional_dataclass(hints[name]) if isinstance(value, dict) else hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value, f"{source} [{name}]")
        else:
            kwargs[name] = _check_type(value, hint, f"{source}: {cls.__name__}.{name}")
    missing = [
        f.name
        for f in fields.values()
        if f.name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {missing} for {cls.__name__}")
    return cls(**kwargs)


def _optional_dataclass(hint: Any) -> Any:
    """The dataclass of an optional section (`SpeculativeConfig | None`), else the hint itself."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        classes = [k for k in typing.get_args(hint) if dataclasses.is_dataclass(k)]
        return classes[0] if classes else hint
    return hint


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Checks a TOML scalar against a field's type; ints are accepted where floats are expected."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value  # the dataclass validates the choice with a better message
    allowed = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return value
        if typing.get_origin(kind) is Literal and isinstance(value, str):
            return value  # as above: the dataclass names the choices
        if typing.get_origin(kind) is tuple and isinstance(value, list):
            # A TOML array; tuples keep the frozen dataclass hashable. tuple[float, ...] or of a Literal.
            item_hint = typing.get_args(kind)[0]
            return tuple(_check_type(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value))
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind in (int, str, bool) and type(value) is kind:
            return value
    names = [getattr(k, "__name__", str(k)) for k in allowed]
    raise ConfigError(f"{where} = {value!r} has type {type(value).__name__}; expected {' or '.join(names)}")


def load_toml(cls: type, path: str | Path | Traversable) -> Any:
    """`path`: a file, or a preset inside the package (paths.presets)."""
    if isinstance(path, str):
        path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return from_dict(cls, data, str(path))
