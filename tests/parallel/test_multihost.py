"""Two processes on loopback, one pipeline stage each (jax.distributed, gloo, socket transfers),
started by the CLI exactly as the README shows: the leader prints the one-process tokens, even with
a stranger sending code to every port the job opens; processes started with different flags are
refused; a follower that dies or stalls makes the leader fail with a clear error and exit non-zero,
in bounded time."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import psutil
import pytest

from orca_jax.config import REPO_ROOT

TINY = str(REPO_ROOT / "checkpoints" / "tiny")
ENGINE_FLAGS = ["--model", TINY, "--policy", "chunked", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
                "--kv-cache-memory", "1MiB"]
PROMPTS = ["<s> 1 2", "<s> 5 6 7", "<s> 10 20", "<s> 3 6 9 12", "<s> 40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orca_jax(*args: str, cpu_devices: int = 1, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(cpu_devices)}  # default: one stage each
    return subprocess.Popen([sys.executable, "-m", "orca_jax.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs)


def start_pair(generate_args: list[str], step_timeout: float = 60.0, follower_flags: tuple[str, ...] = (),
               cpu_devices: int = 1) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = free_port()
    hosts = ["--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
             "--step-timeout", str(step_timeout)]
    follower = orca_jax("generate", *ENGINE_FLAGS, "--pipeline-parallel-size", "2", *hosts, "--process-id", "1",
                        *follower_flags, cpu_devices=cpu_devices)
    leader = orca_jax("generate", *ENGINE_FLAGS, "--pipeline-parallel-size", "2", *hosts, "--process-id", "0",
                      *generate_args, cpu_devices=cpu_devices)
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


class RunsCode:
    """Unpickled, it creates the file `marker`: proof that a process ran a stranger's code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Stranger(threading.Thread):
    """Connects to every port the job's processes listen on, as soon as it opens, and sends a
    pickle that runs code (length-prefixed, as the old plan channel read them); it also tries the
    coordinator's port + 1, where that channel listened. It spares the ports of jax's cross-host
    transfer server, which each process names on stderr: that server aborts its process on a
    malformed message (a jax limitation the README states), which would end the test, not prove
    anything about ours."""

    def __init__(self, processes: list[subprocess.Popen], extra_port: int, marker, stderr_lines):
        super().__init__(daemon=True)
        self.processes, self.extra_port, self.stderr_lines = processes, extra_port, stderr_lines
        payload = pickle.dumps(RunsCode(marker))
        self.payload = struct.pack("!Q", len(payload)) + payload
        self.visited: set[int] = set()
        self.stop = threading.Event()

    def transfer_ports(self) -> set[int]:
        return {int(line.rsplit(":", 1)[1]) for line in list(self.stderr_lines) if "transfers listen at" in line}

    def listening_ports(self) -> set[int]:
        ports = set()
        for process in self.processes:
            try:
                connections = psutil.Process(process.pid).net_connections(kind="tcp")
            except psutil.Error:
                continue
            ports |= {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}
        return ports

    def run(self) -> None:
        while not self.stop.is_set():
            spared = self.transfer_ports()
            if len(spared) == len(self.processes):  # before that, a new port may be a transfer server
                for port in (self.listening_ports() | {self.extra_port}) - self.visited - spared:
                    try:
                        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
                            conn.sendall(self.payload)
                            self.visited.add(port)
                    except OSError:
                        pass  # not listening (yet): tried again on the next round
            time.sleep(0.1)


def read_stderr(process: subprocess.Popen, lines: list[str]) -> threading.Thread:
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stderr.readline, "")), daemon=True)
    reader.start()
    return reader


def test_two_processes_print_the_one_process_tokens(one_process_output, tmp_path):
    marker = tmp_path / "a stranger ran code"
    leader, follower = start_pair(["--max-tokens", "12", *PROMPTS])
    coordinator_port = int(leader.args[leader.args.index("--coordinator-address") + 1].rpartition(":")[2])
    leader_err, follower_err = [], []
    readers = [read_stderr(leader, leader_err), read_stderr(follower, follower_err)]
    stranger = Stranger([leader, follower], coordinator_port + 1, marker, _Joined(leader_err, follower_err))
    stranger.start()
    try:
        out = leader.stdout.read()
        code, follower_code = leader.wait(300), follower.wait(60)
    finally:
        stranger.stop.set()
        for process in (leader, follower):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    stranger.join()
    for reader in readers:
        reader.join(10)
    err = "".join(leader_err)
    assert code == 0, err
    assert out == one_process_output
    assert "compilations after warm-up: 0" in err
    assert "layers 0-0 on [0], layers 1-1 on [2048]" in err  # one stage on each process's device
    assert follower_code == 0, "".join(follower_err)  # told by the leader that it was done
    # Each process read only its own stage's parameters: the embedding and layer 0, or layer 1, the
    # final norm and the (tied) embedding as the LM head; 20 in all.
    assert "read 10 of 20 parameters" in err
    assert "read 11 of 20 parameters" in "".join(follower_err)
    assert coordinator_port in stranger.visited  # jax's coordination service, reached and sent code
    # No plan channel of our own: nothing in the multi-host code listens or unpickles. (Not "port + 1
    # is closed": jax's own transfer servers take ports near the coordinator's by chance.)
    for module in ("parallel/multihost.py", "parallel/plan_codec.py", "runner/follower.py"):
        source = (REPO_ROOT / "orca_jax" / module).read_text()
        assert not any(call in source for call in ("create_server", ".listen(", "import pickle", "pickle.load")), module
    assert not marker.exists()


class _Joined:
    """Two growing lists read as one (the stranger reads both processes' stderr)."""

    def __init__(self, *parts: list[str]):
        self.parts = parts

    def __iter__(self):
        return iter([line for part in self.parts for line in list(part)])


def test_processes_started_with_different_flags_stop_with_both_settings():
    leader, follower = start_pair(["--max-tokens", "4", *PROMPTS[:1]], follower_flags=("--page-size", "8"))
    code, out, err = finish(leader, 300)
    follower_code, _, follower_err = finish(follower, 60)
    for process_code, process_err in ((code, err), (follower_code, follower_err)):
        assert process_code == 2, process_err[-2000:]
        assert "different engine settings" in process_err
        assert "kv_layout.page_size: leader 16, process 1 8" in process_err, process_err[-2000:]
    assert ">>>" not in out


def test_local_device_ids_pick_the_devices_each_process_computes_on(one_process_output):
    """Two CPU devices in each process, each process taking its second: the two stages lie on those
    (without the ids the job's first two devices, both the leader's, would take them)."""
    take_second = ("--local-device-ids", "1")
    leader, follower = start_pair(["--max-tokens", "12", *PROMPTS, *take_second], follower_flags=take_second,
                                  cpu_devices=2)
    code, out, err = finish(leader, 300)
    follower_code, _, follower_err = finish(follower, 60)
    assert code == 0, err[-3000:]
    assert follower_code == 0, follower_err[-3000:]
    assert "layers 0-0 on [1], layers 1-1 on [2049]" in err, err[-3000:]  # process 1's devices: 2048, 2049
    assert out == one_process_output


def test_a_local_device_id_a_process_lacks_stops_every_process():
    leader, follower = start_pair(["--max-tokens", "4", *PROMPTS[:1]], follower_flags=("--local-device-ids", "5"))
    code, _, err = finish(leader, 300)
    follower_code, _, follower_err = finish(follower, 60)
    assert follower_code == 2 and "process 1 has no device 5; its cpu devices are [0]" in follower_err, follower_err
    assert code == 2 and "process 1 could not take its --local-device-ids" in err, err[-3000:]


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


def test_dummy_weights_over_two_processes_print_the_one_process_ids():
    weights = ("--load-format", "dummy", "--dummy-seed", "3")
    prompts = ["--prompt-token-ids", "64 1 2", "--prompt-token-ids", "64 30 31 32", "--max-tokens", "6"]
    code, one_process, err = finish(orca_jax("generate", *ENGINE_FLAGS, *weights, *prompts), 300)
    assert code == 0, err
    assert "are RANDOM (seed 3)" in err
    assert one_process.splitlines()[0] == ">>> 64 1 2"
    assert all(word.isdigit() for word in one_process.splitlines()[1].split())  # generated ids, not text
    leader, follower = start_pair([*weights, *prompts], follower_flags=weights)
    code, out, err = finish(leader, 300)
    follower_code, _, follower_err = finish(follower, 60)
    assert code == 0, err
    assert out == one_process
    assert follower_code == 0, follower_err
