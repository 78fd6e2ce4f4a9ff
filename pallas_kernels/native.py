"""Ragged paged attention on the CPU in C++ (cpu/ragged_paged_attention.cc), called through jax.ffi.

The kernel contract (docs/design.md, "The kernel contract"), as for the Pallas kernel:

    ragged_paged_attention_native(q[T, Hq, Dh], k_pages[P, page, Hkv, Dh], v_pages[P, page, Hkv, Dh],
                                  segment_ids[T], positions[T], block_tables[S, max_pages], kv_lens[S],
                                  *, sm_scale, sliding_window=None, soft_cap=None) -> [T, Hq, Dh]

Token t of segment s attends to the cached tokens of s at positions <= positions[t] and below
kv_lens[s] (and inside its sliding window; scores soft-capped: `check_options`), reading only the
pages inside the window; query head h reads KV head h // (Hq // Hkv); a token whose segment id is outside [0, S)
is padding and gives zeros; tokens may come in any order. q and the output are float32 or bfloat16,
the pages float32 or bfloat16 (converted to f32 as they are read); the math is f32.

Layout of the computation (the .cc file says more): a work item is a run of up to 16 consecutive
tokens of one segment times one KV head. It reads the segment's pages in place (no gather copy),
scores each K row against the run's tokens x the G query heads of its KV head while the row is in
L1, keeps an online softmax per row, and adds each V row to all rows at once. Decode attention thus
reads each cached K/V byte once per step, which is what bounds it. Items run on XLA's intra-op
thread pool.

The same library holds the quantized matmul kernel (cpu/quantized_matmul.cc; its wrapper and
reference are in quantized_matmul.py), built, loaded and variant-selected with the attention kernel.

Build: `unavailable_reason(cache_dir)` has g++ compile the sources once into the directory its
caller chooses (orca_jax passes `native/` under its one cache directory; `make setup` runs
`python -m orca_jax.native`), named by a hash of the source, flags, compiler and jax versions; a
file lock and an atomic rename keep concurrent processes from building twice or loading half a
file. The kernels run once it has loaded the library; this package imports nothing from orca_jax.
No -march=native: the library holds AVX-512, AVX2 and baseline code and picks the best the CPU has
at load (`select_isa` or $ORCA_JAX_NATIVE_ISA a lower one), so it may be copied between x86 machines.
`unavailable_reason(cache_dir)` says why the library cannot be used (no compiler, failed build); callers
then fall back to the XLA path (orca_jax.model.paged_attention).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from pallas_kernels.ragged_paged_attention import check_inputs, check_options, ragged_paged_attention_reference

SOURCE_DIR = Path(__file__).resolve().parent / "cpu"
SOURCE = SOURCE_DIR / "ragged_paged_attention.cc"
# One library holds every native kernel (they share the variant selection below).
SOURCES = (SOURCE, SOURCE_DIR / "quantized_matmul.cc", SOURCE_DIR / "quantized_matmul_int8.cc")
HEADERS = (SOURCE_DIR / "parallel_for.h", SOURCE_DIR / "per_isa.h", SOURCE_DIR / "vec16.h", SOURCE_DIR / "quantized_matmul.h",
           SOURCE_DIR / "ragged_paged_attention_kernel.inc", SOURCE_DIR / "quantized_matmul_kernel.inc",
           SOURCE_DIR / "quantized_matmul_kquants.inc", SOURCE_DIR / "quantized_matmul_int8_kernel.inc",
           SOURCE_DIR / "k_quant_headers.inc")
TARGET = "orca_ragged_paged_attention"
SYMBOL = "OrcaRaggedPagedAttention"
WRITE_TARGET, WRITE_SYMBOL = "orca_write_kv", "OrcaWriteKV"
MATMUL_TARGET, MATMUL_SYMBOL = "orca_quantized_matmul", "OrcaQuantizedMatmul"
# -fopenmp-simd: honour the source's `omp simd` reductions (vectorised without -ffast-math), no
# OpenMP runtime. The instruction sets are chosen per function inside the source.
CXX_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp-simd", "-fvisibility=hidden")
INSTALL_HINT = "install g++ 11 or later (e.g. `apt-get install g++`) or point $CXX at a C++20 compiler"
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
# The instruction-set variants of every kernel, best first, numbered as the source's `Isa`. The VNNI
# ones (AVX-512 VNNI: Zen 4/5, Xeon since Cascade Lake; AVX-VNNI: Intel since Alder Lake, Zen 5) differ
# in the int8-activation matmul only: the float kernels run their AVX-512 or AVX2 code there
# (FLOAT_CODE), so a test of a float kernel need not repeat them.
ISAS = ("avx512vnni", "avx512", "avxvnni", "avx2", "base")
FLOAT_CODE = {"avx512vnni": "avx512", "avx512": "avx512", "avxvnni": "avx2", "avx2": "avx2", "base": "base"}
# Runs a lower variant than the CPU's best in this process (e.g. `avx2` or `base` on an AVX-512
# machine), so the code an AVX2-only CPU runs can be tested anywhere.
ISA_ENV = "ORCA_JAX_NATIVE_ISA"

__all__ = ["ISAS", "isa", "keys_read", "ragged_paged_attention_native", "ragged_paged_attention_reference", "select_isa",
           "supported_isas", "unavailable_reason", "write_kv_native"]


class NativeUnavailable(RuntimeError):
    """The native library could not be built or loaded; the message says why and what to install."""


def _compiler() -> tuple[str, str]:
    """(path, version line) of $CXX (default g++); NativeUnavailable when it is missing."""
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise NativeUnavailable(f"no C++ compiler {name!r} on PATH; {INSTALL_HINT}")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60).stdout
    return path, version.splitlines()[0] if version else "unknown"


def library_path(compiler_version: str, cache_dir: Path) -> Path:
    """Where in `cache_dir` the library for this source, these flags, this compiler and this jax lives."""
    key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES + HEADERS), *CXX_FLAGS, compiler_version, jax.__version__,
                                    jaxlib.__version__]).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"ragged_paged_attention-{key}.so"


def build(cache_dir: Path) -> Path:
    """Compiles the library unless it is already there; returns its path. One process builds, the
    others wait on the lock and find the file; it appears whole (renamed into place) or not at all."""
    compiler, version = _compiler()
    path = library_path(version, cache_dir)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.with_suffix(".lock")):
        if path.is_file():
            return path
        fd, scratch = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            command = [compiler, *CXX_FLAGS, "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o", scratch]
            result = subprocess.run(command, capture_output=True, text=True, timeout=600)
            if result.returncode:
                tail = " | ".join(result.stderr.strip().splitlines()[-5:])
                raise NativeUnavailable(f"building {', '.join(f.name for f in SOURCES)} with {version} failed: {tail}; {INSTALL_HINT}")
            os.replace(scratch, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(scratch)
    return path


@contextlib.contextmanager
def _locked(lock_path: Path):
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps loads whole
        yield
        return
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@functools.cache
def _registered(path: Path) -> ctypes.CDLL:
    """Loads the library and registers its handlers with XLA, once per process and file; applies
    $ORCA_JAX_NATIVE_ISA."""
    library = ctypes.cdll.LoadLibrary(str(path))
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(library, SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(WRITE_TARGET, jax.ffi.pycapsule(getattr(library, WRITE_SYMBOL)), platform="cpu")
    jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(getattr(library, MATMUL_SYMBOL)), platform="cpu")
    forced = os.environ.get(ISA_ENV)
    if forced:
        _select(library, forced, f"${ISA_ENV}={forced!r}")
    return library


def _library() -> ctypes.CDLL:
    _require_loaded()
    return _loaded


def supported_isas() -> tuple[str, ...]:
    """The variants this CPU can run, best first (the baseline always)."""
    library = _library()
    return tuple(name for number, name in enumerate(ISAS) if library.OrcaNativeCpuHas(number))


def isa() -> str:
    """The variant the kernels run with: the CPU's best unless one was selected."""
    return ISAS[_library().OrcaNativeIsa()]


def keys_read() -> int:
    """Cached key rows (keys x KV heads) the attention kernel has read in this process, all calls
    together: tests count what a sliding window saves with it."""
    library = _library()
    library.OrcaNativeKeysRead.restype = ctypes.c_int64
    return library.OrcaNativeKeysRead()


def select_isa(name: str) -> None:
    """Runs every later call with variant `name` (one of ISAS that this CPU has), process-wide: for
    tests and benchmarks that compare the variants. The compiled programs need no rebuild."""
    _select(_library(), name, f"select_isa({name!r})")


def _select(library: ctypes.CDLL, name: str, asked: str) -> None:
    if name not in ISAS:
        raise ValueError(f"{asked}: the native attention variants are {', '.join(ISAS)}")
    if not library.OrcaNativeSelectIsa(ISAS.index(name)):
        has = [n for number, n in enumerate(ISAS) if library.OrcaNativeCpuHas(number)]
        raise ValueError(f"{asked}: this CPU cannot run the {name} variant; it has {', '.join(has)}")


_NOT_TRIED = object()
_attempt = _NOT_TRIED  # the first call's answer: XLA knows the kernel by fixed names, so a process loads one library
_loaded: ctypes.CDLL | None = None  # that library, once it loaded


def unavailable_reason(cache_dir: Path) -> str | None:
    """None when the kernel is built (in `cache_dir`, if not there yet), loaded and registered;
    otherwise why not, in one sentence that says what to install. Tried once per process: later
    calls get the first answer, whatever directory they name (`forget_attempt` starts over)."""
    global _attempt
    if _attempt is _NOT_TRIED:
        _attempt = _try_loading(cache_dir)
    return _attempt


def forget_attempt() -> None:
    """Lets the next `unavailable_reason` try again (tests of the build and of its failures)."""
    global _attempt
    _attempt = _NOT_TRIED


def _try_loading(cache_dir: Path) -> str | None:
    global _loaded
    try:
        _loaded = _registered(build(cache_dir))
    except NativeUnavailable as error:
        return str(error)
    except (OSError, subprocess.SubprocessError) as error:
        return f"the native attention library could not be built or loaded ({error}); {INSTALL_HINT}"
    return None


def _require_loaded() -> None:
    if _loaded is None:
        raise NativeUnavailable("the native attention library is not loaded; call unavailable_reason(cache_dir) "
                                "first, which builds and loads it")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "pages"))
def ragged_paged_attention_native(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    pages: tuple[int, int] | None = None,
) -> jax.Array:
    """See the module docstring. `pages` (first, count): the pages of k_pages and v_pages this
    call reads, to which block_tables' page numbers are relative (a layer's share of arrays that
    hold every layer's); None: all of them. Raises NativeUnavailable when the library is not loaded."""
    check_inputs(q, k_pages, v_pages, segment_ids, positions, block_tables, kv_lens)
    first_page, layer_pages = _page_range(pages, k_pages)
    check_options(sliding_window, soft_cap)
    for name, array in (("q", q), ("k_pages", k_pages)):
        if array.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"ragged_paged_attention_native: {name} must be float32 or bfloat16, got {array.dtype}")
    _require_loaded()
    # The kernel takes q and gives its output in f32: converting them here costs a few KB per call,
    # against the pages' MBs, and halves the variants compiled.
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    int32 = lambda array: array.astype(jnp.int32)
    out = call(q.astype(jnp.float32), k_pages, v_pages, int32(segment_ids), int32(positions), int32(block_tables),
               int32(kv_lens), sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
               soft_cap=np.float32(soft_cap or 0.0), first_page=np.int64(first_page),
               layer_pages=np.int64(layer_pages))
    return out.astype(q.dtype)


def _page_range(pages: tuple[int, int] | None, k_pages: jax.Array) -> tuple[int, int]:
    """(first page, page count) of a call's pages, checked against the page arrays."""
    first, count = (0, k_pages.shape[0]) if pages is None else pages
    if first < 0 or count < 0 or first + count > k_pages.shape[0]:
        raise ValueError(f"pages {first}..{first + count} lie outside the {k_pages.shape[0]} pages of k_pages")
    return first, count


def write_kv_native(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                    slot_mapping: jax.Array, pages: tuple[int, int] | None = None) -> tuple[jax.Array, jax.Array]:
    """Writes k, v [T, K, Dh] into the pages' slots (page * page_size + offset) in place (the results
    alias the page arguments; donate them). `pages` (first, count): the pages the slots count from
    and lie in (None: all). Slots outside them are skipped. For bfloat16 pages: XLA:CPU's own scatter
    converts the whole page array to write a few rows."""
    first_page, layer_pages = _page_range(pages, k_pages)
    _require_loaded()
    call = jax.ffi.ffi_call(WRITE_TARGET, (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                                           jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
                            input_output_aliases={0: 0, 1: 1})
    return call(k_pages, v_pages, k.astype(jnp.float32), v.astype(jnp.float32), slot_mapping.astype(jnp.int32),
                first_page=np.int64(first_page), layer_pages=np.int64(layer_pages))
