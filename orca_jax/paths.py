"""Where orca_jax finds its files: the presets it ships, and the models and caches it writes.

Presets (model configs, the engine defaults) are package data. They live in the repository's top-level
configs/; `orca_jax/configs` is a link to it and pyproject.toml ships the files behind the link, so a
source checkout, an editable install, a wheel and an sdist all read them from inside the package.

Models and caches go under one data directory, $ORCA_JAX_HOME (default ~/.cache/orca_jax):

    checkpoints/          named checkpoints (`orca-jax pull`, `orca-jax convert`)   $ORCA_JAX_CHECKPOINTS
    compilation_cache/    compiled programs, the native kernels' library          $ORCA_JAX_COMPILATION_CACHE

The variable on the right moves that one folder. Run from a source checkout with ORCA_JAX_HOME unset,
the checkout keeps its own checkpoints/ (the committed tiny model, what `make pull` fetched) and
.jax_cache/, as before there was a data directory. This module does not import jax.
"""

from __future__ import annotations

import importlib.resources
import os
from importlib.resources.abc import Traversable
from pathlib import Path

# The folder above the package: the source checkout when running from one, site-packages once installed.
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def source_checkout() -> Path | None:
    """The source checkout this package runs from (an editable install, PYTHONPATH), None once installed."""
    return _PACKAGE_PARENT if (_PACKAGE_PARENT / "pyproject.toml").is_file() else None


def data_home() -> Path:
    """The data directory: $ORCA_JAX_HOME, else ~/.cache/orca_jax."""
    home = os.environ.get("ORCA_JAX_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "orca_jax"


def _data_folder(variable: str, in_home: str, in_checkout: str) -> Path:
    """$<variable>, else <data home>/<in_home>; a checkout without ORCA_JAX_HOME uses its own <in_checkout>."""
    override = os.environ.get(variable)
    if override:
        return Path(override).expanduser()
    checkout = source_checkout()
    if checkout is not None and not os.environ.get("ORCA_JAX_HOME"):
        return checkout / in_checkout
    return data_home() / in_home


def checkpoint_root() -> Path:
    """Where named checkpoints live (a bare model name means checkpoint_root()/name)."""
    return _data_folder("ORCA_JAX_CHECKPOINTS", "checkpoints", "checkpoints").resolve()


def compilation_cache_dir() -> Path:
    """The one directory of every on-disk cache (JAX's compilations, stored executables, the native
    kernels' build), so one setting moves or clears them all."""
    return _data_folder("ORCA_JAX_COMPILATION_CACHE", "compilation_cache", ".jax_cache")


def presets(kind: str) -> Traversable:
    """The shipped presets of one kind: "models" (one ModelConfig TOML each) or "engine" (default.toml)."""
    return importlib.resources.files("orca_jax") / "configs" / kind


def is_gguf_file(name_or_path: str | os.PathLike) -> bool:
    """Whether a model setting names a GGUF file, served as it is, rather than a checkpoint or a preset
    (by its suffix, as llama.cpp and vLLM tell them apart)."""
    return str(name_or_path).lower().endswith(".gguf")
