"""The GPU run's dry run (bench/gpu_run.sh --smoke, `make gpu-dry-run`): the whole script, with
bench/gpu_check.py at tiny shapes, runs end to end on CPU with gguf and llguidance unimportable as on
the GPU image, so it cannot rot unseen before a GPU is lent; on CPU the gpu tests are reported as not
run, never as passed."""

import json
import os
import re
import subprocess
import sys

from gpu_check import GPU_TESTS
from orca_jax.config import REPO_ROOT


def test_the_gpu_run_completes_on_cpu_without_the_optional_packages(tmp_path):
    done = subprocess.run(["bash", "bench/gpu_run.sh", "--smoke", str(tmp_path)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run.log").read_text()
    assert done.stdout.strip().endswith(log.strip().splitlines()[-1])  # the log holds what was printed
    for name in ("jax", "tests", "kernels", "engine"):  # the summary: each section ran and succeeded
        assert re.search(rf"^{name} +ok +\d+ s$", log, re.MULTILINE), (name, log[-1500:])
    for name in ("gguf", "llguidance"):  # as on the image
        assert f"{name}: cannot be imported" in log, log[:3000]

    report = (tmp_path / "tests.xml").read_text()  # every gpu test collected, none run here
    counts = dict(re.findall(r'(tests|skipped|failures|errors)="(\d+)"', report)[:4])
    assert int(counts["tests"]) >= 10 and counts["skipped"] == counts["tests"], counts
    for path in GPU_TESTS:  # where gpu_run.sh took them from (gpu_check.py --print-gpu-tests)
        assert re.search(rf'classname="{re.escape(path.removesuffix(".py").replace("/", "."))}[".]', report), path

    kernels = json.loads((tmp_path / "gpu_check_kernels.json").read_text())
    assert kernels["smoke"] and kernels["platform"] == "cpu" and kernels["sections"] == ["kernels"]
    assert [row["batch"] for row in kernels["kernels"]] == ["decode", "prefill", "mixed"]
    for row in kernels["kernels"]:  # the Pallas kernel (interpreted here) and XLA both agree with the reference
        assert row["pallas_max_abs_error"] < 1e-5 and row["xla_max_abs_error"] < 1e-5, row
        assert row["pallas_ms"] > 0 and row["xla_ms"] > 0

    engine = json.loads((tmp_path / "gpu_check_engine.json").read_text())
    assert "errors" not in engine and "kernels" not in engine
    info, *rows = engine["engine"]
    assert info["weight_bytes"] > 0 and engine["bandwidth_source"].startswith("measured copy on")
    assert [row["batch"] for row in rows] == [1, 4]
    for row in rows:
        assert row["decode_steps"] >= 1 and row["decode_tok_per_s"] > 0
        assert 0 <= row["host_ms"] <= row["step_ms"]
        assert row["bytes_per_step"] > info["weight_bytes"]  # weights plus the KV read
        assert 0 < row["mbu"] < 1.5, row  # of a measured copy's speed: a wrong byte count shows here
    assert "| engine | tiny-dummy B=4 |" in log
