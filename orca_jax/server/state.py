"""The server's state: its settings, the engine (once built), the bounded queue and the current
request's log record. No jax.

Handlers and middlewares find the one `ServerState` at `request.app[STATE]`; `app.py` puts it there.
The engine is reached only through `AsyncLLMEngine`'s public surface (generate, validate, the
tokenizer and the limits), never the `LLMEngine` inside it, which belongs to the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.metrics import ServerMetrics
from orca_jax.server.protocol import APIError

API_KEY_ENV = "ORCA_JAX_API_KEY"


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the id clients put in "model"
    api_key: str | None = None  # None: no auth
    max_queued_requests: int = 256  # sequences allowed to wait beyond the running batch
    max_request_bytes: int = 1 << 20
    retry_after_s: int = 1  # what a 503 tells the client to wait
    enable_request_log: bool = False  # a log line per finished request (never its text)
    chat_template: str | None = None  # Jinja source replacing the model's chat template (--chat-template)
    tool_call_parser: str = "hermes"  # the model's tool-call format (tool_calls.TOOL_CALL_PARSERS)


class ServerState:
    def __init__(self, settings: ServerSettings, engine_factory: Callable[[], AsyncLLMEngine]):
        self.settings = settings
        self.engine_factory = engine_factory
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.loaded = asyncio.Event()  # set when the engine is ready or failed to build
        self.metrics = ServerMetrics(lambda: self.engine.stats if self.engine is not None else None)
        self.draining = False
        self.num_in_flight = 0  # sequences admitted and not yet finished
        self.handler_tasks: set[asyncio.Task] = set()

    def start_loading(self) -> None:
        """Builds the engine on a daemon thread (a stop during warm-up need not wait for it)."""
        loop = asyncio.get_running_loop()

        def build() -> None:
            try:
                engine = self.engine_factory()
            except BaseException as error:  # noqa: BLE001 - reported by serve(), which exits non-zero
                loop.call_soon_threadsafe(self._loaded, None, error)
            else:
                loop.call_soon_threadsafe(self._loaded, engine, None)

        threading.Thread(target=build, name="orca-jax-warm-up", daemon=True).start()

    def _loaded(self, engine: AsyncLLMEngine | None, error: BaseException | None) -> None:
        if engine is not None:
            engine.step_listener = self.metrics.on_step
        self.engine, self.load_error = engine, error
        self.loaded.set()

    @property
    def capacity(self) -> int:
        """Sequences the server holds at once: the running batch plus the bounded waiting queue."""
        return self.engine.max_num_seqs + self.settings.max_queued_requests

    def unavailable(self, message: str) -> APIError:
        return APIError(503, message, type="service_unavailable", code="service_unavailable",
                        headers={"Retry-After": str(self.settings.retry_after_s)})

    def require_engine(self) -> AsyncLLMEngine:
        if self.draining:
            raise self.unavailable("the server is shutting down; retry against another replica")
        if self.engine is None:
            raise self.unavailable("the model is still loading and compiling; retry shortly (see GET /health)")
        return self.engine

    @contextlib.contextmanager
    def admitted(self, num_sequences: int):
        """Holds `num_sequences` places for the request's lifetime, or refuses it at once (fast 503)."""
        if self.num_in_flight + num_sequences > self.capacity:
            raise self.unavailable(
                f"the server is at capacity ({self.num_in_flight} sequences running or queued, limit "
                f"{self.capacity}); retry after {self.settings.retry_after_s} s")
        self.num_in_flight += num_sequences
        try:
            yield
        finally:
            self.num_in_flight -= num_sequences


STATE = web.AppKey("state", ServerState)


@dataclass
class RequestRecord:
    """What the request log says about a request; its handler fills it in."""
    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0


# The record of the request the current task serves (the middleware and its handler share the task).
_RECORD: contextvars.ContextVar[RequestRecord] = contextvars.ContextVar("orca_jax_request_record")


def begin_request_record() -> RequestRecord:
    """A fresh record for the request the current task serves (the request-log middleware's)."""
    record = RequestRecord()
    _RECORD.set(record)
    return record


def request_record() -> RequestRecord:
    return _RECORD.get()
