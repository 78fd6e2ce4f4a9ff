"""A CPU runner's weights in 2 MB pages (runner/huge_pages.py)."""

import ctypes
import logging
import mmap
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.runner.huge_pages import HUGE_PAGE, back_with_huge_pages, collapse

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Whether this kernel may back memory with 2 MB pages at all (THP not `never`, MADV_COLLAPSE)."""
    major, minor = re.match(r"(\d+)\.(\d+)", Path("/proc/sys/kernel/osrelease").read_text()).groups()
    release = (int(major), int(minor))
    return THP.exists() and "[never]" not in THP.read_text() and release >= (6, 1)


def huge_kb_around(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and all(c in "0123456789abcdef-" for c in first):
            start, end = (int(bound, 16) for bound in first.split("-"))
            inside = start <= address < end
        elif inside and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def buffer_address(array) -> int:
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


def own_mapping(size: int):
    """`size` bytes of fresh private anonymous memory (as malloc's), written, in a mapping of their
    own: inaccessible guard pages on both sides keep the kernel from merging it with a neighbour,
    whose huge pages (an earlier test's) would count in its smaps entry. Returns (the mmap, the
    memory's address)."""
    region = mmap.mmap(-1, size + 2 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for guard in (base, base + mmap.PAGESIZE + size):
        assert libc.mprotect(guard, mmap.PAGESIZE, 0) == 0  # PROT_NONE
    np.frombuffer(region, np.uint8, size, mmap.PAGESIZE)[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    return region, base + mmap.PAGESIZE


def test_a_buffers_spans_are_collapsed_into_huge_pages():
    size = 4 * HUGE_PAGE  # 8 MB hold at least 3 whole 2 MB spans, however they are aligned
    region, address = own_mapping(size)
    done = collapse([(address, size)])
    if not thp_available():
        assert done.spans == 0 and done.refused and done.reason, done
        return
    # (the spans shared with the guard pages are refused: the kernel collapses a span only where it
    # can take all of it)
    assert done.spans >= 3, done
    assert huge_kb_around(address + size // 2) >= 3 * 2048
    # The contents are the same bytes after the move to huge pages.
    np.testing.assert_array_equal(np.frombuffer(region, np.uint8, size, mmap.PAGESIZE),
                                  np.arange(size, dtype=np.uint64).astype(np.uint8))


def test_an_xla_buffers_spans_are_collapsed():
    array = jnp.arange(4 * HUGE_PAGE // 4, dtype=jnp.float32) + 1  # 8 MB that XLA allocated
    done = back_with_huge_pages([array])
    if thp_available():
        assert done.spans >= 3, done
    else:
        assert done.spans == 0 and done.refused and done.reason, done
    # Moved or not, the array holds the same values.
    np.testing.assert_array_equal(np.asarray(array), np.arange(array.size, dtype=np.float32) + 1)


def test_a_cpu_runners_weights_are_in_huge_pages(tiny_runner):
    if not thp_available():
        pytest.skip("this kernel has no transparent huge pages (or no MADV_COLLAPSE)")
    largest = max(tiny_runner.weight_arrays(), key=lambda leaf: leaf.nbytes)
    assert huge_kb_around(buffer_address(largest)) >= 2048


def test_a_runner_warns_when_no_span_could_move(tiny_trained, monkeypatch, caplog):
    """THP `never` (or a kernel without MADV_COLLAPSE) refuses every span: the user hears of it."""
    from orca_jax.engine.step_plan import Buckets
    from orca_jax.engine_args import config_from_keywords
    from orca_jax.runner import model_runner
    from orca_jax.runner.huge_pages import Collapsed

    refused = Collapsed(spans=0, refused=4, reason="madvise: EINVAL (Invalid argument)")
    monkeypatch.setattr(model_runner, "back_with_huge_pages", lambda arrays: refused)
    settings = config_from_keywords(page_size=4, attention_impl="xla")
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        model_runner.ModelRunner(tiny_trained.model, settings, num_pages=16, max_model_len=64,
                                 buckets=Buckets(tokens=(16,), seqs=(4,)))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("4 spans left in 4 KB pages (madvise: EINVAL" in message for message in warnings), warnings
