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
    for name in ("jax", "tests", "kernels", "engine", "sweep"):  # the summary: each section ran and succeeded
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

    sweep = json.loads((tmp_path / "gpu_block_sweep.json").read_text())
    assert sweep["smoke"] and {row["kernel"] for row in sweep["rows"]} == {"decode", "query_block"}
    for row in sweep["rows"]:  # every candidate ran and agrees with the reference (a knob that broke it shows)
        assert "failed" not in row and row["max_abs_error"] < 1e-5 and row["ms"] > 0, row
    assert re.search(r"^DEFAULTS row: \(16, 16, 4, ", log, re.MULTILINE), log[-1500:]


def test_every_block_size_the_sweep_tries_lowers_for_cuda():
    """GPU time is scarce: each candidate of gpu_block_sweep.py's grids (from a shape's defaults) goes
    through the whole Pallas -> Triton lowering here, with a grid of its own block_q."""
    import jax.numpy as jnp

    from gpu_block_sweep import DECODE, PREFILL, candidates
    from pallas_kernels import default_block_sizes
    from tests.pallas_kernels.test_gpu_export import export_for_cuda, triton_kernels

    default = default_block_sizes(128, 16, jnp.bfloat16)
    tried = candidates(default, DECODE) + candidates(default, PREFILL)[1:]
    assert len(set(tried)) == 9 + 18 - 1  # the two grids, the default (in both) once
    for block_sizes in tried:
        kernels = triton_kernels(export_for_cuda(128, 16, 32, 8, 128, 16, jnp.bfloat16, block_sizes=block_sizes))
        assert kernels == {"ragged_paged_attention_decode": (16, 8),
                           "ragged_paged_attention": (128 // block_sizes.block_q, 8)}, block_sizes
