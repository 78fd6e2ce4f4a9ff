"""One real run: `orca-jax serve` started with a settings file, a workload replayed against it.

The server runs as its own process (`python -m orca_jax.cli serve --config FILE`, a free port), so
the run measures what a user would get from those settings, HTTP and all. The client waits until
/health says the server is ready and has given every program its first run (a measured request
must not meet one), then sends each request at its arrival offset: a streamed `/v1/completions` of
the request's prompt token ids, greedy, `ignore_eos` so it generates exactly max_tokens. From the
stream, per request: time to first token (from its scheduled arrival to the first chunk that
carries a token) and time per output token (from the first token's chunk to the chunk that
finishes the request, over the tokens after the first).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import aiohttp

SERVED_NAME = "tune"


@dataclass
class Measured:
    ok: bool
    ttft_s: float = math.nan
    tpot_s: float = math.nan  # nan for a request of one token
    output_tokens: int = 0
    error: str = ""
    # On time.perf_counter()'s clock (CLOCK_MONOTONIC on Linux, as the server's time.monotonic()):
    # when the request was due, when its POST went out, its first token chunk.
    scheduled_at: float = math.nan
    sent_at: float = math.nan
    first_at: float = math.nan


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(config: Path, log: Path, ready_timeout_s: float = 900.0,
                   launcher: tuple[str, ...] = (sys.executable, "-m", "orca_jax.cli"),
                   env: dict[str, str] | None = None) -> Iterator[str]:
    """A server process serving `config` until the block ends (then SIGTERM); yields its URL once it
    is ready. Its output goes to `log`; a server that exits or never gets ready raises RuntimeError
    naming the log. `launcher`, `env`: another entry point taking the CLI's arguments and variables
    added to the environment (bench/trace_server.py's traced server)."""
    port = free_port()
    command = [*launcher, "serve", "--config", str(config), "--port", str(port),
               "--served-model-name", SERVED_NAME, "--max-queued-requests", "1000000"]
    with open(log, "w") as out:  # the child keeps its own copy of the handle
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(url, process, ready_timeout_s, log))
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_ready(url: str, process: subprocess.Popen, timeout_s: float, log: Path) -> None:
    """Returns once the server at `url` answers /health 200 with every program's first run done;
    raises RuntimeError naming `log` if `process` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with status {process.returncode} before it was ready; "
                                   f"see {log}")
            try:
                async with session.get(url + "/health") as response:
                    if response.status == 200 and (await response.json())["first_runs_left"] == 0:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server at {url} was not ready within {timeout_s:.0f} s; see {log}")


async def _one(session: aiohttp.ClientSession, url: str, prompt_token_ids: list[int], max_tokens: int,
               scheduled: float) -> Measured:
    body = {"model": SERVED_NAME, "prompt": prompt_token_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    sent = time.perf_counter()

    def failed(error: str) -> Measured:  # timed too: ttft_breakdown matches failed requests to the trace
        return Measured(False, error=error, scheduled_at=scheduled, sent_at=sent)

    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                return failed(f"{response.status}: {(await response.text())[:200]}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if "error" in chunk:
                    return failed(chunk["error"]["message"])
                if chunk["choices"]:  # every chunk with a choice carries new tokens
                    now = time.perf_counter()
                    first = now if first is None else first
                    last = now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except aiohttp.ClientError as error:
        return failed(str(error))
    if first is None:
        return failed("the stream carried no token")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else math.nan
    return Measured(True, first - scheduled, tpot, tokens, scheduled_at=scheduled, sent_at=sent, first_at=first)


async def _replay(url: str, requests: list[tuple[list[int], int]], arrivals: list[float],
                  progress: Callable[[], None] | None) -> tuple[list[Measured], float]:
    # A fresh connection per request, as bench_serving.py found pooled keep-alive connections fragile.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        start = time.perf_counter()

        async def at(offset: float, prompt: list[int], max_tokens: int) -> Measured:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            result = await _one(session, url, prompt, max_tokens, start + offset)
            if progress:
                progress()
            return result

        results = await asyncio.gather(*(at(a, p, m) for a, (p, m) in zip(arrivals, requests)))
        return list(results), time.perf_counter() - start


def replay(url: str, requests: list[tuple[list[int], int]], arrivals: list[float],
           progress: Callable[[], None] | None = None) -> tuple[list[Measured], float]:
    """Each (prompt token ids, max_tokens) sent at its arrival offset (seconds); the per-request
    measurements, in order, and the run's wall time."""
    return asyncio.run(_replay(url, requests, arrivals, progress))


def engine_counters(url: str) -> dict[str, float]:
    """The server's engine counters from /metrics (iterations, generated tokens, preemptions), to
    set beside the simulation's."""
    import urllib.request

    wanted = {"orca_jax_iterations_total": "steps", "orca_jax_generation_tokens_total": "generated_tokens",
              "orca_jax_preemptions_total": "preemptions"}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            counters[wanted[name]] = float(value)
    return counters
