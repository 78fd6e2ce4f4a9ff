"""A CPU runner's weights backed by 2 MB pages (Linux's transparent huge pages).

Every decode step streams all of the weights from memory. In 4 KB pages, a 100 MB model spans
25,000 pages, many times what the TLB holds, so the stream misses the TLB every 4 KB, and in a
virtual machine each page walk goes through the host's tables too. With THP in its usual `madvise`
mode, nothing that XLA allocates gets 2 MB pages by itself. So once the weights are placed, each
2 MB span their buffers touch is marked MADV_HUGEPAGE and collapsed at once with MADV_COLLAPSE
(Linux 6.1). The collapse copies into fresh 2 MB pages, which the kernel may first have to make by
compacting memory: here the first GiB a process collapsed took about 6 s (a second, reusing freed
2 MB pages, 0.3 s), so the KV pages, which a step reads only in part, are left as they are. A span
may hold other allocations too: they stay as they were, only now in a 2 MB page. Where the kernel
cannot (THP `never`, an older kernel, no free 2 MB page) the memory stays in 4 KB pages, which is
only slower; the result says how much was collapsed.

Measured on an AMD EPYC Zen 4 (2 cores, a VM): a plain read of 256 MB went 21-22 -> 26-29 GB/s on
one thread and 25 -> 30-33 GB/s on two; one request decoding the SmolLM2 Q4_K_M file, rounds
alternated, 3-14% more tokens a second (bench/results/HISTORY.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import math
import mmap
import os
import sys
from typing import Iterable

import jax
import numpy as np

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <linux/mman.h>
MADV_COLLAPSE = 25


@dataclasses.dataclass
class Collapsed:
    """What `back_with_huge_pages` did: 2 MB spans now in a huge page, and those the kernel refused
    (with the first refusal's reason)."""

    spans: int = 0
    refused: int = 0
    reason: str = ""

    @property
    def megabytes(self) -> int:
        return self.spans * HUGE_PAGE >> 20


def _mapped_runs() -> list[tuple[int, int]]:
    """This process's mapped addresses as runs [start, end) of adjacent mappings (a buffer can span
    several, once an earlier madvise split its mapping), from /proc/self/maps."""
    runs: list[list[int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(bound, 16) for bound in line.split(maxsplit=1)[0].split("-"))
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
    return [(start, end) for start, end in runs]


def _buffers(arrays: Iterable[jax.Array]) -> list[tuple[int, int]]:
    """(address, bytes) of each CPU buffer of the arrays."""
    buffers = []
    for array in arrays:
        for shard in array.addressable_shards:
            if shard.device.platform == "cpu" and shard.data.nbytes:
                buffers.append((shard.data.unsafe_buffer_pointer(), shard.data.nbytes))
    return buffers


def back_with_huge_pages(arrays: Iterable[jax.Array]) -> Collapsed:
    """Puts the 2 MB spans that the CPU buffers of `arrays` touch into huge pages (see the module's
    docstring); arrays on other devices are left alone. Linux only: elsewhere nothing is done."""
    return collapse(_buffers(arrays))


def collapse(buffers: list[tuple[int, int]]) -> Collapsed:
    """Puts the 2 MB spans that the memory ranges (address, bytes) touch into huge pages."""
    done = Collapsed()
    if not buffers or not sys.platform.startswith("linux"):
        return done
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    runs = _mapped_runs()
    spans = set()
    for address, size in buffers:
        run = next(((start, end) for start, end in runs if start <= address < end), None)
        if run is None:
            continue
        # The 2 MB spans the buffer touches that lie wholly in mapped memory (madvise refuses
        # unmapped addresses).
        first = max(address // HUGE_PAGE, -(-run[0] // HUGE_PAGE))
        end = min(-(-(address + size) // HUGE_PAGE), run[1] // HUGE_PAGE)
        spans.update(range(first, end))
    for span in sorted(spans):
        start = span * HUGE_PAGE
        if libc.madvise(start, HUGE_PAGE, MADV_HUGEPAGE) == 0 and libc.madvise(start, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done.spans += 1
            continue
        done.refused += 1
        if not done.reason:
            code = ctypes.get_errno()
            done.reason = f"madvise: {errno.errorcode.get(code, code)} ({os.strerror(code)})"
    return done


def huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array in memory of its own, 2 MB-aligned and marked for 2 MB pages before
    anything touches it: writing it faults in huge pages directly, so it needs no collapse (a copy)
    afterwards. What is read into it and handed to a CPU device without a copy (jnp.from_dlpack)
    is in 2 MB pages from the start. Elsewhere than Linux, a plain numpy array."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if not sys.platform.startswith("linux") or nbytes == 0:
        return np.empty(shape, dtype)
    # An anonymous mapping is page-aligned, not always 2 MB-aligned: one huge page more leaves room to align it.
    region = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(MADV_HUGEPAGE)
    whole = np.frombuffer(region, np.uint8)  # keeps the mapping alive as long as any view of it
    offset = -whole.ctypes.data % HUGE_PAGE
    return whole[offset:offset + nbytes].view(dtype).reshape(shape)
