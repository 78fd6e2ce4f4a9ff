"""Helpers for the deployment tests: external tools (promtool, prometheus, hadolint) and the deploy/ folder.

A missing tool is a skip on a developer machine, with the command that installs it, but a failure
when $ORCA_JAX_REQUIRE_DEPLOY_TOOLS is set (.ci/run sets it after installing them), so CI can never
pass these tests as skips.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from orca_jax.config import REPO_ROOT

from ..server.conftest import tiny_server  # noqa: F401 - the end-to-end test's server

DEPLOY = REPO_ROOT / "deploy"
REQUIRE_ENV = "ORCA_JAX_REQUIRE_DEPLOY_TOOLS"


def require_tool(name: str, install: str) -> str:
    """The path of `name` (on PATH or beside this Python, for pip-installed tools), else skip or fail."""
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if path is not None:
        return path
    message = f"{name} is not installed; {install}"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{message} (${REQUIRE_ENV} is set: this run must have it)")
    pytest.skip(message)


def require_promtool() -> str:
    return require_tool("promtool", "apt-get install prometheus (Debian/Ubuntu) ships it")


def require_prometheus() -> str:
    return require_tool("prometheus", "apt-get install prometheus (Debian/Ubuntu)")


def serve_config(args: list[str], monkeypatch):
    """Parses `orca-jax serve ARGS` with the real command line and builds its EngineConfig and
    DistributedConfig, without loading anything: unknown flags and bad values fail as they would in a pod."""
    from orca_jax import cli

    assert args[0] == "serve", args
    seen = []

    def capture(parsed):
        seen.append((parsed, cli.engine_config(parsed), cli.distributed_config(parsed)))
        return 0

    monkeypatch.setattr(cli, "_serve", capture)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):  # flags only
        monkeypatch.delenv(name, raising=False)
    try:
        code = cli.main(args)
    except SystemExit as exit:  # argparse: unknown flag or bad value (its message went to stderr)
        pytest.fail(f"orca-jax {' '.join(args)} is refused by the command line (exit {exit.code})")
    assert code == 0 and len(seen) == 1, f"orca-jax {' '.join(args)} failed with {code}"
    return seen[0]
