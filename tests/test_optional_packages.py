"""gguf and llguidance are optional at run time (orca_jax/optional.py): the GPU image lacks both.
With them made unimportable (bench/gpu_image/sitecustomize.py, as the GPU run's dry run has it),
`orca-jax serve` starts on a float checkpoint and answers plain requests; a structured-output request
is refused with a 400 naming llguidance and its pip command, and the GGUF paths name gguf so."""

import http.client
import json
import os
import subprocess
import sys
import time

from orca_jax.config import REPO_ROOT

from .server.test_sigterm import free_port, get_status

TINY = str(REPO_ROOT / "checkpoints" / "tiny")
# Child processes import this folder's sitecustomize first: gguf and llguidance cannot be imported.
WITHOUT_OPTIONAL = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "bench" / "gpu_image"),
                                                                 str(REPO_ROOT)])}


def orca_jax(*args):
    return subprocess.run([sys.executable, "-m", "orca_jax.cli", *args], capture_output=True, text=True,
                          env=WITHOUT_OPTIONAL, timeout=300)


def post(port: int, body: dict) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps(body))
    response = connection.getresponse()
    return response.status, json.loads(response.read())


def test_the_blocked_packages_cannot_be_imported():
    for name in ("gguf", "llguidance"):
        result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True,
                                env=WITHOUT_OPTIONAL)
        assert result.returncode != 0 and "ModuleNotFoundError" in result.stderr, name


def test_the_server_answers_plain_requests_and_names_llguidance_for_a_grammar():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "orca_jax.cli", "serve", "--model", TINY, "--max-num-seqs", "4",
         "--max-num-batched-tokens", "16", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=WITHOUT_OPTIONAL)
    try:
        deadline = time.monotonic() + 180
        while get_status(port, "/health") != 200:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)
        status, body = post(port, {"prompt": [3, 5, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4
        status, body = post(port, {"prompt": [3, 5, 7], "max_tokens": 4, "structured_outputs": {"regex": "[0-9]+"}})
        assert status == 400, body
        message = body["error"]["message"]
        assert "structured outputs" in message and "'llguidance'" in message, message
        assert "pip install 'llguidance>=1.0'" in message, message
    finally:
        server.terminate()
        server.wait(60)


def test_the_gguf_paths_name_the_missing_package(tmp_path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF")
    result = orca_jax("convert", str(file), "--name", "blocked", "--out", str(tmp_path / "out"))
    assert result.returncode != 0
    assert f"reading {file} needs the Python package 'gguf'" in result.stderr, result.stderr
    assert "pip install 'gguf>=0.17'" in result.stderr, result.stderr

    result = orca_jax("generate", "--model", TINY, "--quantization", "gguf", "--max-tokens", "1", "3 5")
    assert result.returncode != 0
    assert "quantization='gguf' needs the Python package 'gguf'" in result.stderr, result.stderr
    assert "pip install 'gguf>=0.17'" in result.stderr, result.stderr
