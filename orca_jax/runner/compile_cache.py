"""Compiled step programs kept between runs, so a second start-up loads instead of compiling.

Every on-disk cache lives under one directory, orca_jax.paths.compilation_cache_dir()
(`$ORCA_JAX_COMPILATION_CACHE`, default `compilation_cache/` in the data directory, `.jax_cache/` in a
source checkout), so one setting moves or clears them all:

    <root>/              JAX's persistent compilation cache (for programs the store cannot keep)
    <root>/executables/  serialized step programs: loaded without tracing, lowering or compiling
    <root>/native/       the native CPU attention library (pallas_kernels.native)

An executable file holds a header naming everything its program depends on (jax and jaxlib versions,
XLA flags, the CPU, the devices' kind and platform version (on a GPU: driver and CUDA runtime), the
installed jax plugins' versions, a hash of this package's source, the model config, the shapes and
placements of its arguments) and a checksum of the payload. It is loaded only when the header equals
what this program would compile now and the checksum matches: a stale entry is ignored and rebuilt, a
corrupt one is ignored with a warning; neither is ever executed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any, Callable

import jax
import jaxlib
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as jax_compilation_cache

from orca_jax.paths import compilation_cache_dir

log = logging.getLogger(__name__)

MAGIC = b"orca_jax executable v1\n"
SOURCE_PACKAGES = ("orca_jax", "pallas_kernels")


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache under the cache root; an explicit jax setting wins."""
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(compilation_cache_dir()))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@functools.cache
def source_hash() -> str:
    """Hash of the packages' Python and C++ sources, wherever they are installed (a checkout or
    site-packages; the same sources hash the same): any edit invalidates every stored program."""
    digest = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        folder = Path(importlib.util.find_spec(package).submodule_search_locations[0])  # without importing it
        for path in sorted(folder.rglob("*")):
            if path.suffix in (".py", ".cc", ".h", ".inc") and path.is_file():
                digest.update(str(path.relative_to(folder.parent)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _machine() -> dict[str, str]:
    """What an executable compiled for this host's CPU depends on: XLA:CPU emits code for the
    instruction sets it finds, so a program built on an AMX Xeon must not run on a Zen 4."""
    cpu = ""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor()
    return {"machine": platform.machine(), "cpu": hashlib.sha256(cpu.encode()).hexdigest()[:16]}


@functools.cache
def _plugin_versions() -> dict[str, str]:
    """Installed jax device plugins (jax-cuda12-plugin, jax-cuda13-pjrt, ...) and their versions: a
    GPU program is compiled by the plugin, so another plugin version must compile its own."""
    versions = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(("jax-cuda", "jax-rocm", "libtpu")):
            versions[name] = dist.version
    return dict(sorted(versions.items()))


def _accelerator(devices) -> dict[str, Any]:
    """What a program compiled for `devices` depends on beyond the host: the device kinds (a program
    built for an H100 must not load on an H200) and the platform version, which on a GPU names the
    CUDA driver and runtime."""
    kinds = sorted({device.device_kind for device in devices})
    platform_versions = sorted({getattr(getattr(device, "client", None), "platform_version", device.platform)
                                for device in devices})
    return {"device_kinds": kinds, "platform_versions": platform_versions, "plugins": _plugin_versions()}


def _describe_args(args) -> list[str]:
    def one(leaf) -> str:
        sharding = getattr(leaf, "sharding", None)
        return f"{leaf.shape} {leaf.dtype} {sharding}"

    return [one(leaf) for leaf in jax.tree.leaves(args)]


def _compile_afresh(lowered):
    """Compiles without JAX's persistent cache: with jax 0.10.2 on CPU, an executable that came from
    that cache serializes without its machine code (loading it fails with "Function ... not found").
    JAX decides once per process whether its cache is on, so switching it off takes a reset, and
    switching it back on another."""
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_compilation_cache.reset_cache()
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        jax_compilation_cache.reset_cache()


class ExecutableStore:
    """Serialized compiled programs in one folder (None: keep nothing, compile every time)."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.loaded = 0  # programs this store loaded instead of compiling (start-up reports it)

    @classmethod
    def default(cls) -> "ExecutableStore":
        return cls(compilation_cache_dir() / "executables")

    def header(self, name: str, args, depends_on: str, devices) -> str:
        """Everything the program `name` compiled for `args` on `devices` depends on, as canonical text."""
        return json.dumps({
            "name": name, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "backend": jax.default_backend(),
            "processes": [jax.process_index(), jax.process_count()], **_machine(), "source": source_hash(),
            **_accelerator(devices), "depends_on": depends_on, "args": _describe_args(args),
        }, sort_keys=True)

    def _path(self, name: str, header: str) -> Path:
        return self.directory / f"{name}-{hashlib.sha256(header.encode()).hexdigest()[:24]}.exe"

    def load_or_compile(self, name: str, args, depends_on: str, lower: Callable[[], Any], out_tree, devices):
        """The compiled program for `args`: from the store when a matching file is there, else
        `lower().compile()`, then stored. `out_tree`: the structure of the program's outputs (the
        store never unpickles pytree structures: they come from the live program); `devices`: the
        ones it runs on, in the order of its mesh."""
        if self.directory is None:
            return lower().compile()
        header = self.header(name, args, depends_on, devices)
        path = self._path(name, header)
        compiled = self._load(path, header, jax.tree.structure((tuple(args), {})), out_tree, devices)
        if compiled is not None:
            self.loaded += 1
            return compiled
        compiled = _compile_afresh(lower())
        self._save(path, header, compiled)
        return compiled

    def _load(self, path: Path, header: str, in_tree, out_tree, devices):
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if not data.startswith(MAGIC):
                raise ValueError("not an orca_jax executable")
            stored_header, checksum, payload = data[len(MAGIC):].split(b"\n", 2)
            if hashlib.sha256(payload).hexdigest() != checksum.decode():
                raise ValueError("checksum mismatch (truncated or altered)")
            stored_header = stored_header.decode()
        except ValueError as error:  # also a short file (too few lines) and bytes that are not UTF-8
            log.warning("ignoring compiled program %s: %s; compiling it again", path, error)
            return None
        if stored_header != header:
            log.info("ignoring compiled program %s: built for other settings", path)
            return None
        try:
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, execution_devices=devices)
        except Exception as error:  # an intact file this jax cannot load: compile instead
            log.warning("cannot load compiled program %s (%s); compiling it again", path, error)
            return None

    def _save(self, path: Path, header: str, compiled) -> None:
        try:
            payload, _, _ = serialize_executable.serialize(compiled)
        except (ValueError, NotImplementedError) as error:
            log.info("compiled program %s cannot be stored: %s", path.name, error)
            return
        data = MAGIC + header.encode() + b"\n" + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Written aside then renamed: a reader (another process starting) never sees half a file.
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as tmp:
                tmp.write(data)
            os.replace(tmp.name, path)
        except OSError as error:
            log.warning("cannot store compiled program in %s: %s", path.parent, error)
