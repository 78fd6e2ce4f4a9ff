"""Two processes on loopback, one pipeline stage each (jax.distributed, gloo, socket transfers),
started by the CLI exactly as the README shows: the leader prints the one-process tokens, and a
follower that dies or stalls makes the leader fail with a clear error and exit non-zero, in
bounded time."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from orca_jax.config import REPO_ROOT

TINY = str(REPO_ROOT / "checkpoints" / "tiny")
ENGINE_FLAGS = ["--model", TINY, "--policy", "chunked", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                "--kv-cache-memory", "1MiB"]
PROMPTS = ["<s> 1 2", "<s> 5 6 7", "<s> 10 20", "<s> 3 6 9 12", "<s> 40"]


def free_port() -> int:
    # The coordinator takes this port and the plan channel the next one: find two free in a row.
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def orca_jax(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)  # one CPU device per process: one stage each
    return subprocess.Popen([sys.executable, "-m", "orca_jax.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs)


def start_pair(generate_args: list[str], step_timeout: float = 60.0) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = free_port()
    hosts = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
             "--step-timeout", str(step_timeout)]
    follower = orca_jax("generate", *ENGINE_FLAGS, "--pipeline-parallel-size", "2", *hosts, "--process-id", "1")
    leader = orca_jax("generate", *ENGINE_FLAGS, "--pipeline-parallel-size", "2", *hosts, "--process-id", "0",
                      *generate_args)
    return leader, follower


def finish(process: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return process.returncode, out, err


@pytest.fixture(scope="module")
def one_process_output():
    code, out, err = finish(orca_jax("generate", *ENGINE_FLAGS, "--max-tokens", "12", *PROMPTS), 300)
    assert code == 0, err
    return out


def test_two_processes_print_the_one_process_tokens(one_process_output):
    leader, follower = start_pair(["--max-tokens", "12", *PROMPTS])
    code, out, err = finish(leader, 300)
    follower_code, _, follower_err = finish(follower, 60)
    assert code == 0, err
    assert out == one_process_output
    assert "compilations after warm-up: 0" in err
    assert "layers 0-0 on [0], layers 1-1 on [2048]" in err  # one stage on each process's device
    assert follower_code == 0, follower_err  # told by the leader that it was done


def wait_for_generation(leader: subprocess.Popen) -> None:
    """Reads the leader's stderr until its engine is past warm-up (generation has started)."""
    deadline = time.monotonic() + 300
    for line in leader.stderr:
        if "warm-up:" in line:
            return
        assert time.monotonic() < deadline, "the leader did not finish warming up"
    raise AssertionError("the leader exited during start-up")


@pytest.mark.parametrize("failure", ["killed", "stalled"])
def test_a_lost_follower_fails_the_leader_in_bounded_time(failure):
    many = [f"<s> {i % 50} {i % 50 + 1}" for i in range(200)]  # 200 counts of ~50 tokens: ~10 s of work
    leader, follower = start_pair(["--max-tokens", "100", *many], step_timeout=5)
    try:
        wait_for_generation(leader)
        time.sleep(0.5)
        os.killpg(follower.pid, signal.SIGKILL if failure == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        code, out, err = finish(leader, 120)
        elapsed = time.monotonic() - start
    finally:
        os.killpg(follower.pid, signal.SIGKILL)
        follower.communicate()
    assert code == 1
    assert "error:" in err and ("follower" in err), err[-2000:]
    assert ">>>" not in out  # no partial results printed as if complete
    assert elapsed < 60


def test_a_follower_whose_leader_dies_exits_non_zero_in_bounded_time():
    many = [f"<s> {i % 50} {i % 50 + 1}" for i in range(200)]
    leader, follower = start_pair(["--max-tokens", "100", *many])
    try:
        wait_for_generation(leader)
        time.sleep(0.5)
        os.killpg(leader.pid, signal.SIGKILL)
        start = time.monotonic()
        code, _, err = finish(follower, 120)
        elapsed = time.monotonic() - start
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
        leader.communicate()
    assert code != 0, err[-2000:]
    assert elapsed < 60
