"""The aiohttp application: server state, middlewares (errors, auth), routes, the engine's lifetime. No jax.

`create_app(state)` builds the app; `serve.py` runs it on a port and drains it. The app's cleanup
context owns the engine: at start-up it builds it (load and compile, minutes) on a daemon thread
while the server already answers (/health says 503 "warming up"); at cleanup it stops the engine
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from aiohttp import web

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.metrics import ServerMetrics
from orca_jax.server.protocol import APIError, invalid

log = logging.getLogger(__name__)
request_log = logging.getLogger("orca_jax.server.requests")

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
        return self.engine.engine.config.scheduler.max_num_seqs + self.settings.max_queued_requests

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
# Paths that need the API key when one is set: the OpenAI API and the tokenizer endpoints.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
UNLOGGED_PATHS = {"/health", "/metrics"}  # probes and scrapes would drown the request log
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer


@dataclass
class RequestRecord:
    """What the request log says about a request; its handler fills it in."""
    request_id: str = "-"
    prompt_tokens: int = 0
    completion_tokens: int = 0


# The record of the request the current task serves (the middleware and its handler share the task).
_RECORD: contextvars.ContextVar[RequestRecord] = contextvars.ContextVar("orca_jax_request_record")


def request_record() -> RequestRecord:
    return _RECORD.get()


def error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def request_log_middleware(request: web.Request, handler):
    """Gives each request its RequestRecord and, with --enable-request-log, logs one line when it ends:
    id, endpoint, status, token counts and latency. Outermost, so it sees the status the client gets."""
    record = RequestRecord()
    _RECORD.set(record)
    if not request.app[STATE].settings.enable_request_log or request.path in UNLOGGED_PATHS:
        return await handler(request)
    start = time.monotonic()
    status = CLIENT_CLOSED
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as error:  # a redirect; errors_middleware turned the failures into responses
        status = error.status
        raise
    finally:
        request_log.info("%s %s %s %d prompt_tokens=%d completion_tokens=%d latency=%.3fs", record.request_id,
                         request.method, request.path, status, record.prompt_tokens, record.completion_tokens,
                         time.monotonic() - start)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure leaves as OpenAI-style JSON, including aiohttp's own 404/405/413."""
    state = request.app[STATE]
    task = asyncio.current_task()
    state.handler_tasks.add(task)
    try:
        return await handler(request)
    except APIError as error:
        return error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        message = f"{error.reason}: {request.method} {request.path}"
        if error.status == 413:
            message = (f"the request body is larger than this server's limit of "
                       f"{state.settings.max_request_bytes} bytes (--max-request-bytes)")
        return error_response(APIError(error.status, message, type=kind))
    except Exception as error:  # noqa: BLE001 - one request's bug must not look like a dead server
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError(500, f"internal error: {error}", type="server_error"))
    finally:
        state.handler_tasks.discard(task)


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """With an API key set, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`;
    /health, /metrics and /version stay open for load balancers and Prometheus."""
    key = request.app[STATE].settings.api_key
    if key and request.path.startswith(PROTECTED_PREFIXES):
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def read_json(request: web.Request) -> object:
    """The body as JSON: 413 past the size limit, 400 for non-UTF-8 or malformed JSON."""
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise invalid(f"the request body is not valid UTF-8 (byte {error.start}); send JSON in UTF-8") from error
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise invalid(f"the request body is not valid JSON: {error}") from error


async def engine_lifetime(app: web.Application):
    """Cleanup context: the engine is built at start-up and its thread stopped at cleanup."""
    state = app[STATE]
    state.start_loading()
    yield
    if state.engine is not None:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown, 30.0)


def create_app(state: ServerState) -> web.Application:
    from orca_jax.server import handlers

    app = web.Application(middlewares=[request_log_middleware, errors_middleware, auth_middleware],
                          client_max_size=state.settings.max_request_bytes)
    app[STATE] = state
    app.cleanup_ctx.append(engine_lifetime)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.retrieve_model)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/detokenize", handlers.detokenize)
    app.router.add_get("/version", handlers.version)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    return app
