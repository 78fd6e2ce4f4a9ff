"""Loading at pp 2 over two processes: each process makes only its own stage's weights, so each one's
peak resident memory is well under that of one process holding the whole model, on a dummy model
whose weights (8 layers, 520 MiB of float32) dominate everything else a process holds.

The processes are the CLI's, as a user starts them; each one's peak RSS is the kernel's own figure
(ru_maxrss from wait4), so a short-lived peak is not missed between samples. Linux carries a
process's peak over fork and exec, so a CLI forked straight from this test process (gigabytes
into the full suite) would report this process's peak: each CLI is forked by a small launcher
process instead, which reports its child's own figure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from .test_multihost import free_port

D, LAYERS, D_FF, VOCAB = 1024, 8, 4096, 2048
WEIGHT_BYTES = 4 * (LAYERS * (4 * D * D + 3 * D * D_FF + 2 * D) + VOCAB * D + D)
MODEL_TOML = f"""name = "wide"
architecture = "llama"
vocab_size = {VOCAB}
d_model = {D}
n_layers = {LAYERS}
n_heads = 8
n_kv_heads = 8
d_ff = {D_FF}
max_position = 64
"""
# The smallest engine that runs (one sequence, three token buckets): the weights dominate.
FLAGS = ["--load-format", "dummy", "--max-num-seqs", "1", "--max-num-batched-tokens", "4", "--kv-cache-memory", "1MiB",
         "--max-model-len", "16", "--prompt-token-ids", "1 2 3", "--max-tokens", "2"]


# argv: the file for the peak (KiB), then the command. A fresh interpreter's peak is ~10 MiB, the
# most its child can inherit.
LAUNCHER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[2:]); "
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
            "sys.exit(code)")


def run_measured(commands: list[list[str]], folder, timeout: float = 240) -> list[tuple[int, str, str, int]]:
    """Runs the CLI commands at once; (exit code, stdout, stderr, peak RSS in bytes) of each."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)  # one CPU device per process: one stage each
    processes, logs = [], []
    for i, command in enumerate(commands):
        out, err = open(folder / f"{i}.out", "w+"), open(folder / f"{i}.err", "w+")  # no pipe to fill up
        logs.append((out, err))
        processes.append(subprocess.Popen([sys.executable, "-c", LAUNCHER, folder / f"{i}.peak", sys.executable, "-m",
                                           "orca_jax.cli", *command], env=env, stdout=out, stderr=err,
                                          start_new_session=True))
    results: dict[int, tuple[int, int]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(processes) and time.monotonic() < deadline:
        for i, process in enumerate(processes):
            if i not in results:
                pid, status, _ = os.wait4(process.pid, os.WNOHANG)
                if pid:
                    results[i] = (os.waitstatus_to_exitcode(status), int((folder / f"{i}.peak").read_text()) * 1024)
        time.sleep(0.1)
    for i, process in enumerate(processes):
        if i not in results:
            os.killpg(process.pid, signal.SIGKILL)
            results[i] = (os.waitstatus_to_exitcode(os.wait4(process.pid, 0)[1]), 0)
        process.returncode = results[i][0]  # reaped here, not by Popen
    outputs = []
    for i, (out, err) in enumerate(logs):
        out.seek(0), err.seek(0)
        outputs.append((results[i][0], out.read(), err.read(), results[i][1]))
        out.close(), err.close()
    return outputs


def test_each_process_at_pp2_peaks_well_under_one_process_holding_the_model(tmp_path):
    model = tmp_path / "wide"
    model.mkdir()
    (model / "model.toml").write_text(MODEL_TOML)
    [(code, one_out, err, one_peak)] = run_measured([["generate", "--model", str(model), *FLAGS]], tmp_path)
    assert code == 0, err[-3000:]
    hosts = ["--pipeline-parallel-size", "2", "--coordinator-address", f"127.0.0.1:{free_port()}",
             "--num-processes", "2"]
    pair = run_measured([["generate", "--model", str(model), *FLAGS, *hosts, "--process-id", str(i)]
                         for i in (1, 0)], tmp_path)
    for code, _, err, _ in pair:
        assert code == 0, err[-3000:]
    (_, _, _, follower_peak), (_, leader_out, _, leader_peak) = pair
    assert leader_out == one_out  # the same model, the same ids
    figures = (f"one process {one_peak / 2**20:.0f} MiB, at pp 2 leader {leader_peak / 2**20:.0f} MiB and follower "
               f"{follower_peak / 2**20:.0f} MiB; weights {WEIGHT_BYTES / 2**20:.0f} MiB")
    # Each process makes half the layers, saving about half the weights (measured on the 2-core Xeon:
    # 900-950 MiB in one process, 606-653 MiB each at pp 2); a process that also made the other
    # stage's layers saves nothing (908 and 938 MiB).
    for peak in (leader_peak, follower_peak):
        assert one_peak - peak > 0.3 * WEIGHT_BYTES, figures
