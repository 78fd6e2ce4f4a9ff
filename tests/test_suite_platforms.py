"""The suite's platform choice (tests/conftest.py): CPU is the default everywhere, and CUDA joins it
only where a CUDA plugin and an NVIDIA device are both present (else jax could fail to start)."""

import glob
import importlib.metadata
import importlib.util
import os
import types
from pathlib import Path

import jax
import pytest

from . import conftest


def test_cpu_is_the_default_platform():
    if not os.environ.get("JAX_PLATFORMS"):
        assert jax.config.jax_platforms.split(",")[0] == "cpu"
    assert jax.default_backend() == "cpu"


@pytest.mark.parametrize("plugins, device_files, want", [
    (["xla_cuda13"], ["/dev/nvidia0"], ["cuda"]),
    (["xla_cuda13"], [], []),  # the plugin installed, no GPU: CPU only
    ([], ["/dev/nvidia0"], []),  # a GPU but no CUDA plugin: jax could not use it
    (["some_tpu_plugin"], ["/dev/nvidia0"], []),
])
def test_cuda_joins_only_with_a_plugin_and_a_device(monkeypatch, plugins, device_files, want):
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [types.SimpleNamespace(name=name) for name in plugins])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # no jax_plugins namespace either
    monkeypatch.setattr(glob, "glob", lambda pattern: device_files if pattern.startswith("/dev/nvidia") else [])
    assert conftest._accelerator_platforms() == want


def test_every_heavy_module_named_is_a_test_module():
    """A renamed or deleted module left in HEAVY_MODULES would silently put its heavy successor back
    into `make test-fast`."""
    tests = {path.stem for path in Path(conftest.__file__).parent.rglob("test_*.py")}
    assert sorted(conftest.HEAVY_MODULES - tests) == []
