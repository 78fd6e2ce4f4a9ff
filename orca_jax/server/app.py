"""The aiohttp application: middlewares (request log, errors, auth), routes, the engine's lifetime. No jax.

`create_app(state)` builds the app; `serve.py` runs it on a port and drains it. The app's cleanup
context owns the engine: at start-up it builds it (load and compile, minutes) on a daemon thread
while the server already answers (/health says 503 "warming up"); at cleanup it stops the engine
thread. The state the app carries is `state.ServerState`; the endpoints are `handlers.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from orca_jax.server import handlers
from orca_jax.server.protocol import APIError
from orca_jax.server.state import STATE, ServerState, begin_request_record

log = logging.getLogger(__name__)
request_log = logging.getLogger("orca_jax.server.requests")

# Paths that need the API key when one is set: the OpenAI API and the tokenizer endpoints.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
UNLOGGED_PATHS = {"/health", "/metrics"}  # probes and scrapes would drown the request log
CLIENT_CLOSED = 499  # nginx's status for a request whose client left before the answer


def error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers)


@web.middleware
async def request_log_middleware(request: web.Request, handler):
    """Gives each request its RequestRecord and, with --enable-request-log, logs one line when it ends:
    id, endpoint, status, token counts and latency. Outermost, so it sees the status the client gets."""
    record = begin_request_record()
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


async def engine_lifetime(app: web.Application):
    """Cleanup context: the engine is built at start-up and its thread stopped at cleanup."""
    state = app[STATE]
    state.start_loading()
    yield
    if state.engine is not None:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown, 30.0)


def create_app(state: ServerState) -> web.Application:
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
