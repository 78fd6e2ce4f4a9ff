"""bench/machine.py's run_with_peak_rss, which the memory benches measure peak RSS with."""

import sys

import machine


def test_each_process_gets_its_own_peak_and_a_full_pipe_stalls_none():
    """Side by side: one process holding 200 MiB for a moment, one writing 4 MiB to stdout (far more
    than a pipe holds: unread, it would block and the polling loop would never end)."""
    hold = [sys.executable, "-c", "import time; b = b'x' * (200 << 20); time.sleep(1)"]
    chatty = [sys.executable, "-c", "import sys; sys.stdout.write('y' * (4 << 20)); sys.stderr.write('done')"]
    big, loud = machine.run_with_peak_rss([hold, chatty])
    assert (big.returncode, loud.returncode) == (0, 0)
    assert big.peak_rss_mib >= 190 and loud.peak_rss_mib < big.peak_rss_mib - 100
    assert len(loud.stdout) == 4 << 20 and loud.stderr == "done" and big.stdout == ""
