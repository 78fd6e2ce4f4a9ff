"""`orca-jax serve` with an iteration-level trace: where a request's time to first token goes.

    ORCA_JAX_TRACE=trace.jsonl python bench/trace_server.py serve --config tuned.toml --port P

The server is the real one (orca_jax.cli); this wrapper only wraps three LLMEngine methods to write
one JSON line per event, stamped with time.monotonic() (the same clock as the load generator's
time.perf_counter() on Linux, and as the handlers' request arrival time):

  {"event": "add", "request": id, "t", "arrival": the handler's arrival time, "prompt_len", "max_tokens"}
      the engine thread took the request from its inbox;
  {"event": "dispatch", "t", "chunks": [[request id, start, num_new, samples], ...]}
      a step was planned and dispatched;
  {"event": "collect", "t0", "t"}  the engine started waiting for the oldest step's result, and had
      it (steps are collected in the order dispatched: the n-th collect is the n-th dispatch's);
  {"event": "first", "request": id, "t"}  its first token was appended (the output goes to the HTTP
      handler right after the engine's step() returns).

The engine serves with its settings unchanged (async scheduling included), so the trace shows the
steps it really runs. bench/ttft_breakdown.py reads it beside the load generator's timings and the
simulation's. Not for production: the trace grows by a line per step and request.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_jax.engine.engine import LLMEngine  # noqa: E402


def install(path: str) -> None:
    out = open(path, "w", buffering=1)  # a line each: the trace survives the server's SIGTERM

    def write(record: dict) -> None:
        out.write(json.dumps(record) + "\n")

    add_request, dispatch, collect, update = (LLMEngine.add_request, LLMEngine._dispatch,
                                              LLMEngine._collect_oldest, LLMEngine._update)

    def traced_add(self, prompt_token_ids, params, request_id=None, prompt=None, arrival_time=None):
        request_id = add_request(self, prompt_token_ids, params, request_id, prompt, arrival_time)
        write({"event": "add", "request": request_id, "t": time.monotonic(), "arrival": arrival_time,
               "prompt_len": len(prompt_token_ids), "max_tokens": params.max_tokens})
        return request_id

    def traced_dispatch(self, scheduled):
        dispatch(self, scheduled)
        write({"event": "dispatch", "t": time.monotonic(),
               "chunks": [[s.request.request_id, s.start, s.num_new_tokens, bool(s.samples)]
                          for s in scheduled.scheduled]})

    def traced_collect(self):
        t0 = time.monotonic()
        result = collect(self)
        write({"event": "collect", "t0": t0, "t": time.monotonic()})
        return result

    def traced_update(self, scheduled, sampled, touched):
        fresh = [s.request for s in scheduled.scheduled if s.samples and not s.request.output_token_ids]
        update(self, scheduled, sampled, touched)
        now = time.monotonic()
        for request in fresh:
            if request.output_token_ids:
                write({"event": "first", "request": request.request_id, "t": now})

    LLMEngine.add_request, LLMEngine._dispatch = traced_add, traced_dispatch
    LLMEngine._collect_oldest, LLMEngine._update = traced_collect, traced_update


if __name__ == "__main__":
    install(os.environ["ORCA_JAX_TRACE"])
    from orca_jax.cli import main

    sys.exit(main(sys.argv[1:]))
