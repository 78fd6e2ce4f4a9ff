"""AsyncLLMEngine: the LLMEngine on its own thread, with per-request asyncio queues.

How the threads meet:

1. One engine thread owns the LLMEngine (and through it the runner and the device). Nothing else
   touches them, so the engine needs no locks.
2. The event loop (the server's handlers) never calls the engine directly. `generate()` puts an
   "add" command on a thread-safe inbox and returns an async iterator over a fresh asyncio.Queue;
   cancelling that iterator (a client that went away) puts an "abort" command on the inbox.
3. The engine thread loops: drain the inbox (adds, aborts), run one `step()`, and hand each
   RequestOutput to its request's queue with `loop.call_soon_threadsafe`. With nothing to do it
   blocks on the inbox instead of spinning.
   The event loop may also read what never changes after start-up (the tokenizer, the limits) and
   `validate` a request against them: the public surface below, all a server needs.
4. After every step the engine thread publishes an EngineStats snapshot (a new frozen object, so a
   reader on another thread never sees it half-written) and calls `step_listener`, if any, with
   it: that is how /metrics sees the scheduler without touching it.
5. A request the engine rejects (RequestRejected, a ValueError naming the limit) fails its own
   iterator with that error. When the runner fails a step (StepFailed), only the requests that
   step scheduled are aborted (pages freed) and failed with EngineStepError; the others, waiting
   or running, go on. Any other exception inside a step leaves the engine's state unknown, so it
   fails every request in flight. Either way the thread keeps serving new requests.
   A request whose event loop has closed (`asyncio.run` returned while it was in flight, a test's
   own loop) cannot be told anything: its outputs are dropped and it is aborted, and the thread
   goes on serving the other loops.
   A request id that is already in flight is refused (a ValueError to the newcomer's iterator);
   the request holding it keeps its queue.
6. When the runner is lost (RunnerLost: a follower process died or stalled), nothing can run any
   more: every request in flight fails with that error, the thread ends, `lost` holds the error and
   `on_lost`, if set, is called with it (the server then shuts down and exits non-zero). Requests
   that arrive afterwards fail at once with the same error.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from orca_jax.config import StructuredOutputsConfig
from orca_jax.engine.engine import LLMEngine, StepFailed
from orca_jax.engine.speculation import SpeculationStats
from orca_jax.engine.step_plan import RunnerLost
from orca_jax.outputs import RequestOutput
from orca_jax.sampling_params import SamplingParams
from orca_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running a step that included this request."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str
    sink: asyncio.Queue  # whose request: a refused duplicate's abort must not end the live request


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV pages in use
    num_preemptions: int = 0
    num_steps: int = 0
    num_generated_tokens: int = 0
    last_step_num_tokens: int = 0  # tokens computed by the latest iteration
    compilations_after_warmup: int = 0
    speculation: SpeculationStats | None = None  # with speculative decoding: a copy of its figures


_STOP = object()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, step_listener: Callable[[EngineStats], None] | None = None):
        self.engine = engine
        self.step_listener = step_listener
        self.on_lost: Callable[[RunnerLost], None] | None = None
        self.lost: RunnerLost | None = None
        self.stats = self._snapshot()
        self._inbox: queue.Queue = queue.Queue()
        self._sinks: dict[str, tuple[asyncio.Queue, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._first_runs_left = engine.runner.run_first_runs(limit=0)  # programs not yet run once
        self._thread = threading.Thread(target=self._run, name="orca-jax-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, *,
                       prompt: str | None = None, request_id: str | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs as they grow; the last one has `finished` set. Leaving the
        iteration early (cancellation, a closed connection) aborts the request. `arrival_time`
        (time.monotonic) defaults to when the engine thread picks the request up."""
        request_id = request_id or f"req-{next(self._ids)}"
        sink: asyncio.Queue = asyncio.Queue()
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params, prompt, arrival_time, sink,
                              asyncio.get_running_loop()))
        if self.lost is not None:  # after the put: the engine thread may have ended before it
            raise EngineStepError(f"the engine stopped: {self.lost}")
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id, sink))

    # ---- what the event loop may ask: fixed at start-up, so safe from any thread ----------------
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + output) one request can ever hold."""
        return self.engine.max_request_tokens

    @property
    def max_num_seqs(self) -> int:
        """Requests the engine runs at once."""
        return self.engine.config.scheduler.max_num_seqs

    @property
    def first_runs_left(self) -> int:
        """Programs whose slow first run is still to come (the engine thread runs them while idle):
        a load test waits for 0 so that no measured request meets one."""
        return self._first_runs_left

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        """The defaults of constrained requests (a forced tool call's grammar is built from them)."""
        return self.engine.config.structured_outputs

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestRejected, naming the limit, for a request that could never be served (what
        `generate` would fail with), so a server can answer 400 before it starts a stream."""
        self.engine.validate(prompt_token_ids, params)

    def shutdown(self, timeout: float | None = None) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            if idle and self._inbox.empty() and self._first_runs_left:
                # Idle time goes to the programs warm-up did not run, one at a time (a request
                # arriving meanwhile waits for at most one): their first run is slow, see
                # ModelRunner.run_first_runs.
                self._first_runs_left = self.engine.runner.run_first_runs(limit=1)
                continue
            # Block only when the engine is idle; otherwise just take what has arrived.
            commands = [self._inbox.get()] if idle else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is _STOP:
                    self._fail(list(self._sinks), EngineStepError("the engine is shutting down"))
                    return
                self._apply(command)
            if not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except RunnerLost as error:
                log.error("the runner is lost; failing every request in flight: %s", error)
                self.lost = error
                failure = EngineStepError(f"the engine stopped: {error}")
                self._fail(list(self._sinks), failure)
                while True:  # requests that arrived during the lost step
                    try:
                        command = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if isinstance(command, _Add):
                        _post(command.loop, [(command.sink, failure)])
                self._publish()
                if self.on_lost is not None:
                    self.on_lost(error)
                return
            except StepFailed as error:
                log.exception("engine step failed; failing its %d request(s)", len(error.request_ids))
                self._fail(error.request_ids, EngineStepError(f"engine step failed: {error}"))
                self._publish()
                continue
            except Exception as error:  # noqa: BLE001 - the engine's state is unknown: fail everything
                log.exception("engine failed outside the runner; failing every request in flight")
                self._fail(list(self._sinks), EngineStepError(f"engine step failed: {error}"))
                self._publish()
                continue
            self._deliver_outputs(outputs)
            self._publish()

    def _snapshot(self) -> EngineStats:
        engine, scheduler = self.engine, self.engine.scheduler
        return EngineStats(
            num_running=scheduler.num_running, num_waiting=len(scheduler.waiting), kv_usage=engine.kv.usage,
            num_preemptions=scheduler.num_preemptions, num_steps=engine.num_steps,
            num_generated_tokens=engine.num_generated_tokens, last_step_num_tokens=engine.last_step_num_tokens,
            compilations_after_warmup=getattr(engine.runner, "num_compilations_after_warmup", 0),
            speculation=None if engine.drafts is None else copy.deepcopy(engine.drafts.stats))

    def _publish(self) -> None:
        self.stats = self._snapshot()
        if self.step_listener is not None:
            try:
                self.step_listener(self.stats)
            except Exception:  # noqa: BLE001 - a broken listener must not stop the engine
                log.exception("step listener failed")

    def _apply(self, command) -> None:
        if isinstance(command, _Abort):
            sink, _ = self._sinks.get(command.request_id, (None, None))
            if sink is command.sink:
                self.engine.abort(command.request_id)
                self._sinks.pop(command.request_id, None)
            return
        # Refused before its sink is registered: the sink under this id is the live request's.
        try:
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id, command.prompt,
                                    command.arrival_time)
        except ValueError as error:
            _post(command.loop, [(command.sink, error)])
            return
        self._sinks[command.request_id] = (command.sink, command.loop)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        """Aborts these requests (their pages are freed) and fails their iterators with `error`."""
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._deliver(request_id, error)
            self._sinks.pop(request_id, None)

    def _deliver(self, request_id: str, item) -> None:
        sink, loop = self._sinks.get(request_id, (None, None))
        if sink is not None and not _post(loop, [(sink, item)]):
            self._drop([request_id])

    def _deliver_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their requests' queues, in one call into each event loop: every
        call_soon_threadsafe wakes its loop through a system call, and one per output per step
        cost the engine thread a system call per streaming request per token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            sink, loop = self._sinks.get(output.request_id, (None, None))
            if sink is not None:
                by_loop.setdefault(loop, []).append((sink, output))
            if output.finished:
                self._sinks.pop(output.request_id, None)
        for loop, deliveries in by_loop.items():
            if not _post(loop, deliveries):
                self._drop([output.request_id for _, output in deliveries])

    def _drop(self, request_ids: list[str]) -> None:
        """Aborts requests whose event loop has closed: nobody is left to read their outputs, and
        their pages serve the other requests better."""
        log.warning("the event loop of %d request(s) has closed; aborting them", len(request_ids))
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._sinks.pop(request_id, None)


def _post(loop: asyncio.AbstractEventLoop, deliveries: list) -> bool:
    """Schedules the (queue, item) puts on `loop`; False where the loop has closed (call_soon_threadsafe
    raises then, and that must not end the engine thread)."""
    try:
        loop.call_soon_threadsafe(_put_each, deliveries)
    except RuntimeError:
        if not loop.is_closed():
            raise
        return False
    return True


def _put_each(deliveries: list) -> None:
    """On the event loop: each (queue, item) put."""
    for sink, item in deliveries:
        sink.put_nowait(item)
