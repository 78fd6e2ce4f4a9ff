"""Which machine and which code a benchmark figure came from.

Every bench script stores `describe()` as "machine" in its result file: the CPU (named down to its
generation where /proc/cpuinfo only says "AMD EPYC"), its vector extensions, the native kernels'
instruction-set variant, the jax version, the date and the commit. A file copied into
bench/results/latest/ then carries everything docs/performance.md prints beside its figures.
`copy_bandwidth()` is the memory speed every bench's "% of memory speed" figure is measured against.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The flags that decide which kernel variant runs and how fast XLA's matmuls are.
FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def amd_generation(family: int, model: int) -> str | None:
    """AMD's family 0x19 holds Zen 3 and Zen 4 (told apart by model), 0x1a is Zen 5."""
    if family == 0x1A:
        return "Zen 5"
    if family == 0x19:
        zen4 = 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF
        return "Zen 4" if zen4 else "Zen 3"
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen"
    return None


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_name() -> str:
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if info.get("vendor_id") == "AuthenticAMD" and "Zen" not in name:
        generation = amd_generation(int(info.get("cpu family", "0")), int(info.get("model", "0")))
        if generation:
            name = f"{name} ({generation})"
    return name


def cpu_flags() -> list[str]:
    flags = set(_cpuinfo().get("flags", "").split())
    return [flag for flag in FLAGS_OF_INTEREST if flag in flags]


def native_isa() -> str:
    """The variant the native kernels run here ($ORCA_JAX_NATIVE_ISA can force a lower one)."""
    try:
        from orca_jax.model.backends import native_cache_dir
        from pallas_kernels import native
    except ImportError as error:  # a bench run outside the package's environment
        return f"unknown ({error})"
    reason = native.unavailable_reason(native_cache_dir())
    return native.isa() if reason is None else f"unavailable ({reason})"


def copy_bandwidth(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes per second a warm numpy copy of a large float32 array moves (its reads plus its writes),
    best of `repeat`: the machine's practical memory speed for one thread, and the one yardstick
    every bench's "% of memory speed" is measured against (the best copy, since on cores shared with
    other jobs the others only ever add time)."""
    import numpy as np

    source = np.ones(nbytes // 4, np.float32)
    target = np.empty_like(source)
    np.copyto(target, source)  # touch the pages once, outside the timing
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def commit() -> str:
    """The checkout's commit; "-dirty" when tracked files differ from it (the figure may not be its)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


@dataclass
class Finished:
    returncode: int
    peak_rss_mib: float  # the largest resident set seen by polling, not the kernel's exact high-water mark
    stdout: str
    stderr: str


def run_with_peak_rss(commands: list[list[str]], env: dict | None = None, interval_s: float = 0.05) -> list[Finished]:
    """Runs the commands side by side (several processes of one job: a leader and its followers) and
    samples each one's resident memory until all have exited. The outputs are read on their own
    threads so that a process writing more than a pipe holds cannot stall the others."""
    import concurrent.futures

    import psutil

    processes = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for c in commands]
    with concurrent.futures.ThreadPoolExecutor(len(processes)) as pool:
        outputs = [pool.submit(p.communicate) for p in processes]
        peaks = [0] * len(processes)
        while any(p.poll() is None for p in processes):
            for i, p in enumerate(processes):
                try:
                    peaks[i] = max(peaks[i], psutil.Process(p.pid).memory_info().rss)
                except psutil.Error:  # exited between poll() and the read
                    pass
            time.sleep(interval_s)
        return [Finished(p.returncode, round(peak / 2**20, 1), *out.result())
                for p, peak, out in zip(processes, peaks, outputs)]


def describe() -> dict:
    import jax

    return {"cpu": cpu_name(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "native_isa": native_isa(),
            "jax": jax.__version__, "date": datetime.date.today().isoformat(), "commit": commit()}
