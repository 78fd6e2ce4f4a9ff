"""Real servers on free ports, run by `serve()` on a background thread with its own event loop.

Servers share the session's compiled runners, so at most one server per runner is alive at a time
(module-scoped fixtures, stopped before the next module starts).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.state import ServerSettings
from orca_jax.server.serve import serve

from ..engine.conftest import SMOLLM2_LIMITS, TINY_LIMITS, make_engine


class ServerThread:
    def __init__(self, engine_factory, settings: ServerSettings, shutdown_timeout: float = 10.0):
        self.engine_factory = engine_factory
        self.settings = settings
        self.shutdown_timeout = shutdown_timeout
        self.state = None
        self.exit_code = None
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, wait_ready: bool = True) -> "ServerThread":
        self._thread.start()
        assert self._listening.wait(60), "the server did not start listening"
        if wait_ready:
            for _ in range(600):
                if self.state.engine is not None:
                    break
                threading.Event().wait(0.1)
            assert self.state.engine is not None, "the engine did not become ready"
        return self

    def _run(self) -> None:
        async def main():
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()

            def listening(state, addresses):
                self.state = state
                host, port = addresses[0][:2]
                self.url = f"http://{host}:{port}"
                self._listening.set()

            return await serve(self.settings, self.engine_factory, "127.0.0.1", 0, stop=self.stop_event,
                               on_listening=listening, install_signal_handlers=False,
                               shutdown_timeout=self.shutdown_timeout)

        self.exit_code = asyncio.run(main())

    def stop(self) -> int:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        return self.wait_exit()

    def wait_exit(self, timeout: float = 60) -> int:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the server did not stop"
        return self.exit_code

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def engine(self):
        return self.state.engine.engine


def tiny_engine_factory(tiny_runner, tiny_trained):
    return lambda: AsyncLLMEngine(make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS))


@pytest.fixture(scope="module")
def smollm2_server(smollm2_runner, smollm2):
    server = ServerThread(lambda: AsyncLLMEngine(make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS)),
                          ServerSettings(model_name="smollm2")).start()
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def tiny_server(tiny_runner, tiny_trained):
    server = ServerThread(tiny_engine_factory(tiny_runner, tiny_trained),
                          ServerSettings(model_name="tiny", max_request_bytes=4096)).start()
    yield server
    assert server.stop() == 0


def http(server: ServerThread, method: str, path: str, body: bytes | dict | None = None,
         headers: dict | None = None, timeout: float = 120) -> tuple[int, dict, bytes]:
    """One plain HTTP request (stdlib, so raw bytes go out exactly as given): status, headers, body."""
    import http.client
    import json
    from urllib.parse import urlsplit

    if isinstance(body, dict):
        body = json.dumps(body).encode()
    url = urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


def sse_events(raw: bytes) -> list[str]:
    """The `data:` payloads of a server-sent-event stream; asserts the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n"), "an SSE stream ends with a blank line"
    events = text[:-2].split("\n\n")
    for event in events:
        assert event.startswith("data: "), f"not an SSE data line: {event[:80]!r}"
    return [event[len("data: "):] for event in events]
