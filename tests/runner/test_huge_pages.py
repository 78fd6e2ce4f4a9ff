"""A CPU runner's weights in 2 MB pages (runner/huge_pages.py)."""

import logging
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from orca_jax.runner.huge_pages import HUGE_PAGE, back_with_huge_pages

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


def fresh_array():
    """8 MB that XLA allocated, in a mapping with no huge page yet (one next to an earlier test's
    collapsed memory could share its mapping's count)."""
    kept = []
    for _ in range(8):
        array = jnp.arange(4 * HUGE_PAGE // 4, dtype=jnp.float32) + 1
        array.block_until_ready()
        if huge_kb_around(buffer_address(array) + array.nbytes // 2) == 0:
            return array
        kept.append(array)  # held, so that the next allocation goes elsewhere
    raise AssertionError("every new 8 MB array landed in a mapping that already has huge pages")


def test_an_arrays_buffer_is_collapsed_into_huge_pages():
    array = fresh_array()
    done = back_with_huge_pages([array])
    middle = buffer_address(array) + array.nbytes // 2
    if not thp_available():
        assert done.spans == 0 and done.refused and done.reason, done
        return
    # 8 MB hold at least 3 whole 2 MB spans (the spans it shares with its neighbours may be refused:
    # the kernel collapses a span only where it can take all of it)
    assert done.spans >= 3, done
    assert huge_kb_around(middle) >= 2048
    # The contents are the same bytes after the move to huge pages.
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
