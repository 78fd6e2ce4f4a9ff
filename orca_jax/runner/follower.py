"""A follower process (multi-host): build the same runner as the leader, then run every plan the
leader sends, in its order (parallel/multihost.py tells how the processes meet and fail).

Apart from the builder and the channel, so that `parallel/multihost.py` (the channel, used by the
builder on the leader) and the builder do not import each other.
"""

from __future__ import annotations

import logging
import sys

from orca_jax.config import ConfigError
from orca_jax.parallel.multihost import DistributedConfig, PlanReceiver
from orca_jax.runner.builder import BuildOptions, build_runner

log = logging.getLogger(__name__)


def follow(runner, dist: DistributedConfig) -> int:
    """A follower's life: run every plan the leader sends, in order. Returns the exit code: 0 when
    the leader said it was done, 1 when it went away or a step failed, 2 when the flags differ."""
    try:
        plans = PlanReceiver(dist, runner.layout_settings())
    except ConfigError as error:
        log.error("%s", error)
        return 2
    log.info("process %d following the leader at %s", dist.process_id, dist.coordinator_address)
    try:
        while (plan := plans.receive()) is not None:
            runner.follow_plan(plan)
        log.info("the leader finished after %d steps", plans.steps)
        return 0
    except ConnectionError as error:
        log.error("lost the leader after %d steps: %s", plans.steps, error)
        return 1
    except Exception as error:  # noqa: BLE001 - a failed step: the processes are out of step for good
        log.error("step %d failed on this process: %s", plans.steps, error)
        return 1


def follow_leader(config, dist: DistributedConfig) -> int:
    """A follower process: build the same runner as the leader, then run its steps until it is done."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runner, _, _ = build_runner(config, BuildOptions(show_progress=False), distributed=dist)
    print(f"orca_jax: process {dist.process_id}: {runner.describe()}", file=sys.stderr, flush=True)
    runner.compile_programs()  # its own stages' programs; the leader's warm-up step then arrives as a plan
    return follow(runner, dist)
