"""The native kernel's build and the fallback when it cannot be built: the library goes into the one
cache directory, and a machine without a working compiler gets the XLA path with one warning (auto)
or an error that says why (native)."""

import logging

import pytest

from orca_jax.config import ConfigError
from orca_jax.model.backends import _warn_once, native_cache_dir, resolve_attention_impl
from pallas_kernels import native

from ..conftest import require_native


@pytest.fixture
def fresh_native(monkeypatch, tmp_path):
    """An empty cache directory and no memory of earlier attempts; the real state comes back after."""
    monkeypatch.setenv("ORCA_JAX_COMPILATION_CACHE", str(tmp_path / "cache"))
    native.forget_attempt()
    _warn_once.cache_clear()
    yield tmp_path
    monkeypatch.undo()
    native.forget_attempt()
    _warn_once.cache_clear()


def test_every_kernel_source_file_is_in_the_library_key():
    """The library's file name hashes the sources and headers it names: a file of pallas_kernels/cpu
    left out of them would let an edit to it reuse the stale library."""
    named = {path.name for path in native.SOURCES + native.HEADERS}
    on_disk = {path.name for path in native.SOURCE_DIR.iterdir()}
    assert on_disk - named == set()  # files the key leaves out
    assert named - on_disk == set()  # names of files that are gone


def test_library_lives_under_the_compilation_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCA_JAX_COMPILATION_CACHE", str(tmp_path))
    path = native.library_path("g++ (test) 1.0", native_cache_dir())
    assert path.parent == tmp_path / "native"
    assert native.library_path("g++ (test) 2.0", native_cache_dir()) != path  # another compiler: another library


def test_no_compiler_falls_back_to_xla_with_one_warning(fresh_native, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh_native / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        assert resolve_attention_impl("auto", "cpu") == "xla"
        assert resolve_attention_impl("auto", "cpu") == "xla"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no-such-compiler" in warnings[0].getMessage() and "install g++" in warnings[0].getMessage()
    with pytest.raises(ConfigError, match="attention_impl='native': no C\\+\\+ compiler"):
        resolve_attention_impl("native", "cpu")


def test_failed_build_is_reported_and_leaves_no_library(fresh_native, monkeypatch):
    compiler = fresh_native / "broken-g++"
    compiler.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'broken-g++ 0.1' && exit 0\n"
                        "echo 'internal compiler error' >&2; exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    reason = native.unavailable_reason(native_cache_dir())
    assert "failed" in reason and "internal compiler error" in reason
    assert not list((fresh_native / "cache" / "native").glob("*.so"))  # no half-written library
    with pytest.raises(native.NativeUnavailable):
        native.build(native_cache_dir())


def test_auto_picks_native_on_cpu_when_it_builds():
    require_native()
    assert resolve_attention_impl("auto", "cpu") == "native"
    assert resolve_attention_impl("auto", "gpu") == "pallas"
    assert native.build(native_cache_dir()) == native.build(native_cache_dir())  # built once, then found
