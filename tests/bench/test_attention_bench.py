"""bench_attention.py's in-program timing (`--chained`): one decode token's call, fed its own output."""

import json
import subprocess
import sys

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
