"""Multi-host: one model over several processes (one per host in production) with jax.distributed.

How the processes meet:

1. Every process calls `initialize(dist)` before jax starts its backend: it sets this process's
   address for cross-process transfers and joins the coordinator (which process 0 hosts). Then
   jax.devices() lists every process's devices, each process computing only on its own.
2. Every process builds the same ModelRunner from the same flags. Stages are laid over the global
   device list, one stage on one process; a process holds parameters, KV arrays and a compiled
   program only for the stages it owns. That list holds each process's own devices, narrowed by its
   `--local-device-ids`; every process learns the others' choice from the store (`job_devices`).
3. Process 0, the leader, runs the scheduler and the server or offline API. The plans reach the
   followers through the key-value store of the coordination service that jax.distributed.initialize
   already runs (on the coordinator's port, inside process 0): no socket of ours, no port beyond
   jax's. At start-up every process publishes its runner's layout settings (model, layout, pages,
   buckets) and compares them with the leader's, so processes started with different flags stop
   with an error naming both settings instead of hanging. Then every step (warm-up included) the
   leader encodes the StepPlan (arrays and integers, parallel/plan_codec.py; nothing is pickled)
   under the key of its step number for each follower (`PlanSender`), and runs it. Why the store and
   not a broadcast over the device collectives: it measured 2.8 ms per step against 5.0 ms
   (bench/bench_plan_channel.py, docs/performance.md), and a collective would make the leader wait
   for a stalled follower inside gloo, where no step timeout reaches.
4. A follower (`runner/follower.py`) takes each plan from the store (`PlanReceiver`) and runs it:
   its own stages, and its side of every cross-process `jax.device_put` (activations from the
   previous stage's process, the sampled tokens back to the leader). Both sides of a transfer must
   make the same call in the same order, which is why every process runs every plan, in the
   leader's order. Only the process of the last stage receives the [S, V] penalty arrays.
5. Failures are bounded: a follower that dies or stalls leaves the leader's wait for a step's result
   to pass `step_timeout` seconds (or breaks the transfer). Either way the leader's runner raises
   RunnerLost, the engine fails every request in flight with it, and the process exits non-zero. A
   follower whose leader goes away loses the coordination service with it and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys

from orca_jax.config import ConfigError
from orca_jax.engine.step_plan import RunnerLost, StepPlan
from orca_jax.parallel.plan_codec import decode_plan, encode_plan

log = logging.getLogger(__name__)

_KEYS = "orca_jax"  # prefix of every key this module puts in the coordination service's store
_DONE = b""  # the plan value that means "no more steps"
# A follower waits for the next plan in slices of this many ms, so that an idle server (no step for
# hours) is waiting, not an error.
_POLL_MS = 10_000


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str  # host:port of process 0's coordination service (jax.distributed), which carries the plans
    num_processes: int
    process_id: int  # 0 is the leader
    step_timeout: float = 60.0  # seconds the leader waits for a step's result before giving up
    connect_timeout: float = 600.0  # seconds to wait for the other processes at start-up (they load and compile)
    # The accelerators this process takes (several processes on one host); None: all it sees
    # (one process per GPU then comes from CUDA_VISIBLE_DEVICES, the standard environment).
    local_device_ids: tuple[int, ...] | None = None

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
    def coordinator(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host, int(port)


def initialize(dist: DistributedConfig) -> None:
    """Joins the process group. Must run before anything touches a jax device."""
    import jax

    host, port = dist.coordinator
    # This process's address for cross-process device_put: the interface that reaches the
    # coordinator, on a free port.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        local_ip = probe.getsockname()[0]
    with socket.socket() as free:
        free.bind((local_ip, 0))
        transfer_port = free.getsockname()[1]
    jax.config.update("jax_cross_host_transfer_socket_address", f"{local_ip}:{transfer_port}")
    # The ports to keep on a private network: jax's transfer server aborts the process on a
    # malformed message (docs/deployment.md), so operators need to know where it listens.
    print(f"orca_jax: process {dist.process_id} of {dist.num_processes}: cross-process transfers listen at "
          f"{local_ip}:{transfer_port}", file=sys.stderr, flush=True)
    # A dead peer then raises in the waiting call instead of aborting this process: the leader can
    # fail its requests with a clear error and exit on its own terms.
    jax.config.update("jax_enable_recoverability", True)
    jax.distributed.initialize(dist.coordinator_address, num_processes=dist.num_processes,
                               process_id=dist.process_id, initialization_timeout=int(dist.connect_timeout),
                               local_device_ids=None if dist.local_device_ids is None else list(dist.local_device_ids))


def job_devices(dist: DistributedConfig) -> list:
    """The job's devices in jax.devices() order: each process's own, narrowed to its
    `local_device_ids` (their numbers on the host, as `local_hardware_id`; 0..n-1 on CPU).

    On GPUs jax.distributed has already made only those visible (CUDA_VISIBLE_DEVICES's job), so a
    process takes all the devices it sees; CPU devices are all visible, so the ids pick among them.
    Every process puts its choice in the store and reads the others': all must lay the stages over
    the same list, and only a process itself knows which of its devices it took."""
    import jax

    client = _client()
    key = f"{_KEYS}/devices/{{}}"
    mine = jax.local_devices()
    if dist.local_device_ids is not None and mine[0].platform == "cpu":
        by_number = {device.local_hardware_id: device for device in mine}
        missing = [i for i in dist.local_device_ids if i not in by_number]
        if missing:
            client.key_value_set(key.format(dist.process_id), "none")  # the others stop too, not wait
            raise ConfigError(f"--local-device-ids {','.join(map(str, dist.local_device_ids))}: process "
                              f"{dist.process_id} has no device {missing[0]}; its cpu devices are {sorted(by_number)}")
        mine = [by_number[i] for i in dist.local_device_ids]
    client.key_value_set(key.format(dist.process_id), ",".join(str(device.id) for device in mine))
    taken = set()
    for process in range(dist.num_processes):
        ids = client.blocking_key_value_get(key.format(process), int(dist.connect_timeout * 1000))
        if ids == "none":
            raise ConfigError(f"process {process} could not take its --local-device-ids (its error says why)")
        taken |= {int(i) for i in ids.split(",")}
    return [device for device in jax.devices() if device.id in taken]


def _client():
    """jax.distributed's client of the coordination service (set up by `initialize`)."""
    from jax._src import distributed

    if distributed.global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized: call multihost.initialize first")
    return distributed.global_state.client


def _is_deadline(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


def layout_differences(leader: dict[str, str], other: dict[str, str], process_id: int) -> list[str]:
    """One line per setting on which a follower differs from the leader, with both values."""
    return [f"{name}: leader {leader.get(name, '(none)')}, process {process_id} {other.get(name, '(none)')}"
            for name in sorted(leader.keys() | other.keys()) if leader.get(name) != other.get(name)]


def _mismatch_error(lines: list[str]) -> ConfigError:
    return ConfigError("the processes were started with different engine settings; give every process the same "
                       "flags:\n  " + "\n  ".join(lines))


class PlanSender:
    """The leader's end: checks every follower's layout, then puts each plan in the store for each."""

    def __init__(self, dist: DistributedConfig, layout: dict[str, str], last_stage_process: int):
        self._client = _client()
        self._followers = range(1, dist.num_processes)
        self._last_stage_process = last_stage_process
        self._step = 0
        self._client.key_value_set_bytes(f"{_KEYS}/layout/0", json.dumps(layout).encode())
        differences = []
        for process in self._followers:
            try:
                theirs = self._client.blocking_key_value_get_bytes(f"{_KEYS}/layout/{process}",
                                                                   int(dist.connect_timeout * 1000))
            except Exception as error:  # noqa: BLE001 - jax raises its own runtime error types
                if not _is_deadline(error):
                    raise RunnerLost(f"lost follower process {process} at start-up: {error}") from error
                raise RunnerLost(f"follower process {process} did not build its runner within "
                                 f"{dist.connect_timeout:.0f} s; start every process with the same flags and "
                                 "--process-id 1..N-1") from None
            differences += layout_differences(layout, json.loads(theirs), process)
        if differences:
            raise _mismatch_error(differences)
        log.info("%d follower process(es) ready", len(self._followers))

    def send(self, plan: StepPlan) -> None:
        """Never waits for a follower: the store is in this process, and a stalled follower shows
        as a missing step result (the runner's `step_timeout`)."""
        encoded = {True: None, False: None}
        try:
            for process in self._followers:
                penalties = process == self._last_stage_process
                if encoded[penalties] is None:
                    encoded[penalties] = encode_plan(plan, with_penalties=penalties)
                self._client.key_value_set_bytes(f"{_KEYS}/plan/{process}/{self._step}", encoded[penalties])
        except Exception as error:  # noqa: BLE001 - the coordination service itself failed
            raise RunnerLost(f"could not hand step {self._step} to the followers: {error}") from error
        self._step += 1

    def close(self) -> None:
        """Tells the followers there are no more steps: they exit 0."""
        for process in self._followers:
            try:
                self._client.key_value_set_bytes(f"{_KEYS}/plan/{process}/{self._step}", _DONE)
            except Exception:  # noqa: BLE001 - a follower already gone needs no goodbye
                pass


class PlanReceiver:
    """A follower's end: publishes its layout, checks the leader's, then yields the plans in order."""

    def __init__(self, dist: DistributedConfig, layout: dict[str, str]):
        self._client = _client()
        self._process = dist.process_id
        self._step = 0
        self._client.key_value_set_bytes(f"{_KEYS}/layout/{self._process}", json.dumps(layout).encode())
        try:
            leader = json.loads(self._client.blocking_key_value_get_bytes(f"{_KEYS}/layout/0",
                                                                          int(dist.connect_timeout * 1000)))
        except Exception as error:  # noqa: BLE001
            raise RunnerLost(f"no word from the leader (process 0) within {dist.connect_timeout:.0f} s: "
                             f"{error}") from error
        differences = layout_differences(leader, layout, self._process)
        if differences:
            raise _mismatch_error(differences)

    @property
    def steps(self) -> int:
        return self._step

    def receive(self) -> StepPlan | None:
        """The next plan, or None when the leader said it was done. ConnectionError when the
        coordination service (and with it the leader) is gone; ValueError for a value that is not
        an encoded plan."""
        key = f"{_KEYS}/plan/{self._process}/{self._step}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except Exception as error:  # noqa: BLE001
                if not _is_deadline(error):
                    raise ConnectionError(f"lost the coordination service: {error}") from error
        self._client.key_value_delete(key)  # the store would otherwise keep every step
        if data == _DONE:
            return None
        self._step += 1
        return decode_plan(data)


def run_process(dist: DistributedConfig, run) -> int:
    """Joins the process group, runs `run()` and ends the process with its exit code. Any failure is
    one `error:` line, and the process always leaves through `os._exit`: with a peer gone, jax's
    own shutdown can block forever in native code. When every process is still there (the job is
    done, or the flags differ), they first leave the group together (`_leave_together`)."""
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
    if code in (0, 2):
        _leave_together(dist)
    sys.stderr.flush()
    os._exit(code)


def _leave_together(dist: DistributedConfig, timeout: float = 15.0) -> None:
    """Every process meets at a barrier, then the followers disconnect, then the leader, whose
    process hosts the coordination service, goes last: a follower still connected when the service
    goes away is aborted by jax (a non-zero exit after a clean end). jax's own shutdown barrier is
    off under `jax_enable_recoverability`, hence this one. Bounded, in case a peer is gone after all."""
    import threading
    import time

    import jax

    def leave() -> None:
        client = _client()
        client.wait_at_barrier(f"{_KEYS}/leave", int(timeout * 1000))
        if not dist.is_leader:
            jax.distributed.shutdown()
            return
        everyone = list(range(dist.num_processes))  # the asking process must be among them
        deadline = time.monotonic() + timeout
        while set(client.get_live_nodes(everyone)) - {0} and time.monotonic() < deadline:
            time.sleep(0.05)
        # The service counts a follower gone when its shutdown starts, before it has answered it:
        # leave it a moment to send that answer.
        time.sleep(0.5)

    leaving = threading.Thread(target=leave, daemon=True)
    leaving.start()
    leaving.join(timeout)
