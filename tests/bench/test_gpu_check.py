"""bench/gpu_check.py --smoke: the first-GPU script runs end to end on CPU at tiny shapes, so it
cannot rot unseen before a GPU is lent; and on CPU it reports the gpu tests as not run."""

import json
import subprocess
import sys

from orca_jax.config import REPO_ROOT


def test_the_gpu_check_runs_on_cpu_and_reports_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--smoke", "--out", str(out)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["platform"] == "cpu"

    tests = result["tests"]  # every gpu test collected, none run here (never counted as passed)
    assert tests["returncode"] == 0 and tests["tests"] >= 10 and tests["skipped"] == tests["tests"]
    assert f"0 passed, 0 failed, {tests['tests']} not run" in done.stdout

    kernels = result["kernels"]
    assert [row["batch"] for row in kernels] == ["decode", "prefill", "mixed"]
    for row in kernels:  # the Pallas kernel (interpreted here) and XLA both agree with the reference
        assert row["pallas_max_abs_error"] < 1e-5 and row["xla_max_abs_error"] < 1e-5, row
        assert row["pallas_ms"] > 0 and row["xla_ms"] > 0

    info, *rows = result["engine"]
    assert info["weight_bytes"] > 0 and result["bandwidth_source"].startswith("measured copy on")
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        assert row["decode_steps"] >= 1 and row["decode_tok_per_s"] > 0
        assert 0 <= row["host_ms"] <= row["step_ms"]
        assert row["bytes_per_step"] > info["weight_bytes"]  # weights plus the KV read
        assert 0 < row["mbu"] < 1.5, row  # of a measured copy's speed: a wrong byte count shows here
    assert "| engine | tiny-dummy B=4 |" in done.stdout
