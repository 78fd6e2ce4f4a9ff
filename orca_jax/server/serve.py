"""Running the server: listen at once, drain on SIGTERM/SIGINT. No jax.

The order matters to operators: the port answers from the first second (GET /health says 503
"warming up" while the app's cleanup context builds the engine), and a stop signal drains rather
than drops:

1. stop accepting connections and answer new requests on open ones with 503;
2. wait up to `shutdown_timeout` seconds for the requests in flight to finish;
3. cancel whatever is left (each cancelled request is aborted in the engine, its pages freed);
4. clean the app up (which stops the engine thread) and return 0.

An engine that loses its runner (a multi-host follower died) stops the server the same way, and
`serve` returns 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Callable

from aiohttp import web

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.app import create_app
from orca_jax.server.state import ServerSettings, ServerState

log = logging.getLogger("orca_jax.server")


async def serve(settings: ServerSettings, engine_factory: Callable[[], AsyncLLMEngine], host: str, port: int, *,
                shutdown_timeout: float = 30.0, stop: asyncio.Event | None = None,
                on_listening: Callable[[ServerState, list], None] | None = None,
                install_signal_handlers: bool = True) -> int:
    """Serves until `stop` is set (or a signal arrives); returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    state = ServerState(settings, engine_factory)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    if install_signal_handlers:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s; loading %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses),
             settings.model_name)
    if on_listening is not None:
        on_listening(state, runner.addresses)

    loading = asyncio.ensure_future(state.loaded.wait())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if state.load_error is not None:
        log.error("could not load the model; shutting down", exc_info=state.load_error)
        exit_code = 1
    elif state.engine is not None:
        log.info("ready: serving %s", settings.model_name)
        state.metrics.set_engine_limits(max_num_seqs=state.engine.max_num_seqs)
        state.engine.on_lost = lambda error: loop.call_soon_threadsafe(stop.set)
        if state.engine.lost is not None:  # lost before the callback was in place
            stop.set()
        await stopping
        if state.engine.lost is not None:
            log.error("stopping: the engine can run no more steps (%s)", state.engine.lost)
            exit_code = 1
    loading.cancel()
    stopping.cancel()

    await _drain(state, site, shutdown_timeout)
    await runner.cleanup()
    log.info("stopped")
    return exit_code


async def _drain(state: ServerState, site: web.TCPSite, timeout: float) -> None:
    state.draining = True
    await site.stop()  # no new connections; open ones get 503 from now on
    in_flight = set(state.handler_tasks)
    log.info("draining: %d request(s) in flight, waiting up to %.0f s", len(in_flight), timeout)
    if in_flight:
        await asyncio.wait(in_flight, timeout=timeout)
    left = list(state.handler_tasks)
    for task in left:
        task.cancel()
    if left:
        log.info("cancelled %d request(s) still running after %.0f s", len(left), timeout)
        await asyncio.gather(*left, return_exceptions=True)
