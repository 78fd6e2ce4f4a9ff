"""A runner's side of the transfers between pipeline stages and between processes (multihost.py
tells how the processes meet): moving a stage's output to the next stage's devices, waiting for a
step's result with a deadline, and pacing a follower that runs ahead of the leader.

Across processes every process runs every plan: its own stages, and its side of each transfer
between processes (a process that does not hold a stage's output passes a placeholder with the
output's shape and no local data).
"""

from __future__ import annotations

import collections
import concurrent.futures

import jax
import numpy as np
from jax.sharding import NamedSharding

from orca_jax.engine.step_plan import RunnerLost


def move(value, source: NamedSharding, source_local: bool, destination: NamedSharding, shapes):
    """`device_put` of a stage's output (on `source`'s devices) to `destination`. Between processes
    both sides make the call: the holder with the data, the other with a placeholder of `shapes`.
    Returns None on a process that is on neither side."""
    receiving = destination.mesh.devices.flat[0].process_index == jax.process_index()
    if not source_local and not receiving:
        return None  # between two other processes
    if not source_local:
        value = jax.tree.map(
            lambda s: jax.make_array_from_single_device_arrays(s.shape, source, [], dtype=s.dtype), shapes)
    return jax.device_put(value, destination)


class ResultWaiter:
    """Copies a step's result back to the host. With several processes a result transfer from
    another process cannot be given a deadline, so the copy waits on a helper thread and the caller
    stops waiting at the deadline (the wait is abandoned, not the step) with RunnerLost.

    On CPU devices the result already is in host memory: each array is read in place (`np.asarray`,
    a read-only view) instead of through `jax.device_get`, whose host copies cost the waiting thread
    0.2 ms of CPU a step more (SmolLM2 Q4_K_M, one request, AMD EPYC Zen 4), taken from the cores
    the kernels run on."""

    def __init__(self, multi_process: bool, host_memory: bool = False):
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, "orca-jax-result") if multi_process else None
        self._host_memory = host_memory

    def wait(self, result, timeout: float | None):
        if self._waiter is None:
            return jax.tree.map(np.asarray, result) if self._host_memory else jax.device_get(result)
        try:
            return self._waiter.submit(jax.device_get, result).result(timeout)
        except concurrent.futures.TimeoutError:
            raise RunnerLost(f"no step result from the other processes within {timeout:.0f} s: a follower "
                             "stalled or died") from None
        except jax.errors.JaxRuntimeError as error:
            raise RunnerLost(f"a follower process failed: {error}") from error


class FollowerPacing:
    """A follower's recent stage outputs: it runs the leader's plans as they come, and waits for the
    oldest once more than `max_in_flight + 1` are queued (past ~32 executions queued, transfers
    deadlock)."""

    def __init__(self, max_in_flight: int):
        self.max_in_flight = max_in_flight
        self._outputs: collections.deque = collections.deque()

    def ran(self, output) -> None:
        self._outputs.append(output)
        if len(self._outputs) > self.max_in_flight + 1:
            jax.block_until_ready(self._outputs.popleft())
