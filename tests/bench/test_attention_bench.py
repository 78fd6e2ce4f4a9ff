"""bench_attention.py's in-program timing (`--chained`): one decode token's call, fed its own output."""

import json
import subprocess
import sys
import time

from orca_jax.config import REPO_ROOT

from ..conftest import require_native


def test_chained_timing_checks_and_times_one_decode_token_per_variant(tmp_path):
    require_native()
    from pallas_kernels import native

    out = tmp_path / "attention.json"
    subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "bench_attention.py"), "--batches", "decode 1x200",
                    "--impls", "native", "--chained", "2", "--repeat", "1", "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["chained"] == 2
    rows = result["rows"]
    assert [row["impl"] for row in rows] == [f"native {isa}" for isa in native.supported_isas()]
    for row in rows:
        assert row["batch"] == "decode 1x200" and row["correct"], row


def test_in_program_timing_gives_the_cost_of_one_call():
    """A call that sleeps 5 ms comes out at about 5 ms a call: the one-call program is subtracted
    and the difference divided by the extra calls (a lower bound only: a loaded host sleeps longer)."""
    import jax
    import numpy as np
    from bench_attention import timed_in_program

    def sleepy(q, scale):
        def host(x):
            time.sleep(0.005)
            return x
        return jax.pure_callback(host, jax.ShapeDtypeStruct(q.shape, q.dtype), q) * scale

    seconds = timed_in_program(sleepy, (np.ones(4, np.float32), np.float32(1.0)), calls=1, repeat=5)
    assert seconds >= 0.004, seconds
