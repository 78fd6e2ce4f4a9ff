"""Multi-host: one model over several processes (one per host in production) with jax.distributed.

How the processes meet:

1. Every process calls `initialize(dist)` before jax starts its backend: it sets this process's
   address for cross-process transfers and joins the coordinator (which process 0 hosts). Then
   jax.devices() lists every process's devices, each process computing only on its own.
2. Every process builds the same ModelRunner from the same flags. Stages are laid over the global
   device list, one stage on one process; a process holds parameters, KV arrays and a compiled
   program only for the stages it owns.
3. Process 0, the leader, runs the scheduler and the server or offline API. It first sends each
   follower its runner's layout key (model, layout, pages, buckets), which the follower checks
   against its own, so processes started with different flags stop with an error instead of
   hanging. Then every step (warm-up included) it sends the StepPlan, plain numpy arrays, to every
   follower over that TCP connection (`PlanSender`, on the coordinator's port + 1), and runs it.
4. A follower (`runner/follower.py`) runs each plan it receives: its own stages, and its side of every
   cross-process `jax.device_put` (activations from the previous stage's process, the sampled
   tokens back to the leader). Both sides of a transfer must make the same call in the same order,
   which is why every process runs every plan, in the leader's order.
5. Failures are bounded: a follower that dies breaks the connection or the transfer; one that stalls
   lets the leader's wait for a step's result pass `step_timeout` seconds. Either way the leader's
   runner raises RunnerLost, the engine fails every request in flight with it, and the process
   exits non-zero. A follower whose leader goes away sees the connection close and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import struct
import sys
import time

from orca_jax.engine.step_plan import RunnerLost, StepPlan

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str  # host:port of process 0's coordinator; plans go out on port + 1
    num_processes: int
    process_id: int  # 0 is the leader
    step_timeout: float = 60.0  # seconds the leader waits for a step's result before giving up
    connect_timeout: float = 600.0  # seconds to wait for the other processes at start-up (they load and compile)

    def __post_init__(self) -> None:
        host, _, port = self.coordinator_address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator address {self.coordinator_address!r} is not host:port, "
                             "e.g. 10.0.0.1:7000 (or 127.0.0.1:7000 on one machine)")
        if self.num_processes < 2:
            raise ValueError(f"num_processes={self.num_processes}: multi-host needs at least 2 processes")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id={self.process_id} must be in [0, {self.num_processes})")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def plan_address(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host, int(port) + 1


def initialize(dist: DistributedConfig) -> None:
    """Joins the process group. Must run before anything touches a jax device."""
    import jax

    host, port = dist.plan_address
    # This process's address for cross-process device_put: the interface that reaches the
    # coordinator, on a free port.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        local_ip = probe.getsockname()[0]
    with socket.socket() as free:
        free.bind((local_ip, 0))
        transfer_port = free.getsockname()[1]
    jax.config.update("jax_cross_host_transfer_socket_address", f"{local_ip}:{transfer_port}")
    # A dead peer then raises in the waiting call instead of aborting this process: the leader can
    # fail its requests with a clear error and exit on its own terms.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id, initialization_timeout=int(dist.connect_timeout))


def _send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def receive(sock: socket.socket):
    header = _receive_exactly(sock, _LENGTH.size)
    return pickle.loads(_receive_exactly(sock, _LENGTH.unpack(header)[0]))


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the leader closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class PlanSender:
    """The leader's end: one connection per follower; every plan goes to all of them."""

    def __init__(self, dist: DistributedConfig, layout_key: str):
        host, port = dist.plan_address
        self._server = socket.create_server(("", port))
        self._server.settimeout(dist.connect_timeout)
        self._followers: list[socket.socket] = []
        try:
            for _ in range(dist.num_processes - 1):
                conn, _ = self._server.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(dist.step_timeout)  # a stalled follower stops reading: bound the send too
                _send(conn, layout_key)
                self._followers.append(conn)
        except socket.timeout:
            raise RunnerLost(f"{len(self._followers)} of {dist.num_processes - 1} follower process(es) connected "
                             f"to port {port} within {dist.connect_timeout:.0f} s; start every process with the "
                             "same flags and --process-id 1..N-1") from None
        log.info("%d follower process(es) connected", len(self._followers))

    def send(self, plan: StepPlan) -> None:
        try:
            for conn in self._followers:
                _send(conn, plan)
        except OSError as error:
            raise RunnerLost(f"lost a follower process while sending a step: {error}") from error

    def close(self) -> None:
        for conn in self._followers:
            try:
                _send(conn, None)  # "no more steps": the follower exits 0
                conn.close()
            except OSError:
                pass
        self._server.close()


def connect_to_leader(dist: DistributedConfig) -> socket.socket:
    """The follower's end, retried while the leader is still loading."""
    deadline = time.monotonic() + dist.connect_timeout
    while True:
        try:
            conn = socket.create_connection(dist.plan_address, timeout=5)
            conn.settimeout(None)  # an idle server sends nothing for hours: wait as long as it lives
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise RunnerLost(f"could not reach the leader at {dist.plan_address} within "
                                 f"{dist.connect_timeout:.0f} s; is process 0 running?") from None
            time.sleep(0.5)


def run_process(dist: DistributedConfig, run) -> int:
    """Joins the process group, runs `run()` and ends the process with its exit code. Any failure is
    one `error:` line, and the process always leaves through `os._exit`: with a peer gone, jax's
    own shutdown can block forever in native code."""
    # Native libraries (gloo) print to file descriptor 1; keep the results alone on stdout by pointing
    # fd 1 at stderr and giving Python's sys.stdout the original stdout.
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w")
    initialize(dist)
    try:
        code = run()
    except BaseException as error:  # noqa: BLE001 - whatever it was, leave through os._exit
        print(f"error: {error}", file=sys.stderr)
        code = 2 if isinstance(error, ValueError) and not isinstance(error, RunnerLost) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
