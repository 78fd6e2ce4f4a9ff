"""A follower process (multi-host): build the same runner as the leader, then run every plan the
leader sends, in its order (parallel/multihost.py tells how the processes meet and fail).

Apart from the builder and the channel, so that `parallel/multihost.py` (the channel, used by the
builder on the leader) and the builder do not import each other.
"""

from __future__ import annotations

import logging

from orca_jax.parallel.multihost import DistributedConfig, connect_to_leader, receive
from orca_jax.runner.builder import BuildOptions, build_runner

log = logging.getLogger(__name__)


def follow(runner, dist: DistributedConfig) -> int:
    """A follower's life: run every plan the leader sends, in order. Returns the exit code: 0 when
    the leader said it was done, 1 when it went away or a step failed, 2 when the flags differ."""
    conn = connect_to_leader(dist)
    log.info("process %d following the leader at %s", dist.process_id, dist.plan_address)
    steps = 0
    try:
        leader_key = receive(conn)
        if leader_key != runner.layout_key():
            log.error("this process was started with other engine settings than the leader; give every "
                      "process the same flags.\n  leader: %s\n  here:   %s", leader_key, runner.layout_key())
            return 2
        while True:
            plan = receive(conn)
            if plan is None:
                log.info("the leader finished after %d steps", steps)
                return 0
            runner.follow_plan(plan)
            steps += 1
    except (ConnectionError, OSError) as error:
        log.error("lost the leader after %d steps: %s", steps, error)
        return 1
    except Exception as error:  # noqa: BLE001 - a failed step: the processes are out of step for good
        log.error("step %d failed on this process: %s", steps, error)
        return 1
    finally:
        conn.close()


def follow_leader(config, dist: DistributedConfig) -> int:
    """A follower process: build the same runner as the leader, then run its steps until it is done."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner, _, _ = build_runner(config, BuildOptions(show_progress=False), distributed=dist)
    runner.compile_programs()  # its own stages' programs; the leader's warm-up step then arrives as a plan
    return follow(runner, dist)
