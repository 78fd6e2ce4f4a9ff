"""The package as a user installs it: a wheel built from these sources, installed (not editable) into a
fresh venv outside the checkout, run from another folder without PYTHONPATH. It serves the committed
tiny model by path over real HTTP, finds a named checkpoint in $ORCA_JAX_HOME and reads its presets from
inside the package (a non-editable install once stopped at "unknown model preset": issue 41).

The venv gets the wheel alone (--no-deps); a .pth file lends it the dependencies of the interpreter
running the tests, whose folder holds no orca_jax (an editable install is a finder that a plain path
line does not activate). About a minute on 2 cores: a wheel build and two engine start-ups (the
native kernels' library is seeded from this checkout's cache, as the images seed theirs; without one
the installed package compiles it, another minute).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

from orca_jax.config import REPO_ROOT
from orca_jax.paths import compilation_cache_dir

pytestmark = pytest.mark.installed

TINY = REPO_ROOT / "checkpoints" / "tiny"
ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "16"]  # the same in both start-ups: one compile


class Installed:
    def __init__(self, root: Path):
        self.venv = root / "venv"
        self.home = root / "home"  # $ORCA_JAX_HOME, empty at first
        self.cwd = root / "elsewhere"  # neither the checkout nor the venv
        self.cwd.mkdir()
        self.env = {name: value for name, value in os.environ.items()
                    if name not in ("PYTHONPATH", "VIRTUAL_ENV") and not name.startswith("ORCA_JAX_")}
        self.env |= {"ORCA_JAX_HOME": str(self.home), "JAX_PLATFORMS": "cpu",
                     "PATH": f"{self.venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(args, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout)

    def orca_jax(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return self.run(str(self.venv / "bin" / "orca-jax"), *args, timeout=timeout)


def _build_wheel(root: Path, env: dict[str, str]) -> Path:
    """`pip wheel` of a copy of what the package is built from (building in place would write build/
    and an egg-info into the checkout); the copy keeps orca_jax/configs a link, as git does."""
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    for name in ("orca_jax", "pallas_kernels", "configs"):
        shutil.copytree(REPO_ROOT / name, source / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir",
                           str(root / "dist"), str(source)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (root / "dist").glob("orca_jax-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    target = Installed(root)
    wheel = _build_wheel(root, target.env)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "orca_jax/configs/models/tiny.toml" in names and "orca_jax/configs/engine/default.toml" in names
    assert "pallas_kernels/cpu/ragged_paged_attention.cc" in names

    # pip gets the clean environment too: a PYTHONPATH naming a checkout that holds an egg-info would read as
    # orca-jax already installed.
    assert target.run(sys.executable, "-m", "venv", "--without-pip", str(target.venv)).returncode == 0
    python = str(target.venv / "bin" / "python")
    done = target.run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", str(wheel))
    assert done.returncode == 0, done.stdout + done.stderr
    site_packages = target.run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout
    Path(site_packages.strip(), "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    # The library's name hashes the sources it is built from: the installed package uses this copy
    # only if its sources are the checkout's, and compiles its own otherwise.
    native = target.home / "compilation_cache" / "native"
    native.mkdir(parents=True)
    for library in (compilation_cache_dir() / "native").glob("*.so"):
        shutil.copy2(library, native)
    return target


def test_the_venv_imports_the_wheel_not_the_checkout(installed):
    done = installed.run(str(installed.venv / "bin" / "python"), "-c",
                         "import orca_jax, pallas_kernels, orca_jax.paths as p; "
                         "print(orca_jax.__file__, pallas_kernels.__file__, p.source_checkout(), p.checkpoint_root())")
    assert done.returncode == 0, done.stderr
    orca_file, kernels_file, checkout, checkpoints = done.stdout.split()
    for file in (orca_file, kernels_file):
        assert Path(file).is_relative_to(installed.venv) and not Path(file).is_relative_to(REPO_ROOT), file
    assert checkout == "None"
    assert Path(checkpoints) == (installed.home / "checkpoints").resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int | None, bytes]:
    """(status, body); status None while nothing listens on the port."""
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        connection.request(method, path, body=None if body is None else json.dumps(body))
        response = connection.getresponse()
        return response.status, response.read()
    except OSError:
        return None, b""


def test_serves_the_tiny_checkpoint_by_path_over_http(installed, tmp_path):
    port = _free_port()
    log = tmp_path / "server.log"
    with log.open("w") as output:
        server = subprocess.Popen([str(installed.venv / "bin" / "orca-jax"), "serve", "--model", str(TINY),
                                   *ENGINE, "--port", str(port)],
                                  cwd=installed.cwd, env=installed.env, stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while _request(port, "GET", "/health")[0] != 200:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the server did not become ready\n" + log.read_text()
            time.sleep(0.5)
        status, body = _request(port, "POST", "/v1/completions",
                                {"prompt": "3 5", "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"].split() == ["7", "9", "11", "13"]
    finally:
        server.terminate()
        server.wait(timeout=120)
    # The compiled programs went to the data directory.
    assert any((installed.home / "compilation_cache" / "executables").iterdir())


def test_generate_finds_a_named_checkpoint_in_the_data_directory(installed):
    shutil.copytree(TINY, installed.home / "checkpoints" / "tiny")
    done = installed.orca_jax("generate", "--model", "tiny", *ENGINE, "--max-tokens", "4", "3 5")
    assert done.returncode == 0, done.stderr
    assert ">>> 3 5\n7 9 11 13\n" in done.stdout


def test_presets_are_read_from_the_package(installed):
    done = installed.orca_jax("plan", "--model", "llama-3-8b", "--device-memory", "40GiB")
    assert done.returncode == 0, done.stderr
    assert "llama-3-8b" in done.stdout
    # A preset without a checkpoint: the fix names the preset (the package's list), not "any checkpoint".
    done = installed.orca_jax("generate", "--model", "tiny-gpt", "3 5")
    assert done.returncode == 2 and "preset 'tiny-gpt' has no published weights here" in done.stderr, done.stderr


def test_bench_says_its_scripts_ship_with_the_checkout(installed):
    done = installed.orca_jax("bench", "serving", "--help")
    assert done.returncode == 2
    assert "the bench scripts ship with the source checkout" in done.stderr, done.stderr
