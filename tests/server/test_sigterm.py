"""`orca-jax serve` as a real process: SIGTERM drains the requests in flight, refuses new ones and
exits 0."""

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.config import REPO_ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_status(port: int, path: str) -> int | None:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", path)
        return connection.getresponse().status
    except OSError:
        return None


def test_sigterm_drains_in_flight_requests_and_exits_0():
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "orca_jax.cli", "serve", "--model", str(REPO_ROOT / "checkpoints" / "tiny"),
         "--max-num-seqs", "4", "--max-num-batched-tokens", "16", "--port", str(port), "--shutdown-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while get_status(port, "/health") != 200:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)

        first_chunk, streams = threading.Barrier(5), []

        def stream(start: int) -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            body = {"prompt": counting_sequence(start, 1)[:3], "max_tokens": 120, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            connection.request("POST", "/v1/completions", body=json.dumps(body))
            response = connection.getresponse()
            first = response.readline()
            first_chunk.wait(30)
            streams.append((response.status, first + response.read()))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        first_chunk.wait(30)  # all four are streaming
        server.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.wait(60) == 0
        log = server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
    assert "draining: 4 request(s) in flight" in log, log
    assert len(streams) == 4
    for status, raw in streams:  # each finished its 120 tokens after the signal
        events = raw.decode().strip().split("\n\n")
        assert status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
        assert len(events) - 1 == 120
    assert get_status(port, "/health") is None  # the port is closed
