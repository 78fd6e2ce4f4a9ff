"""What operators meet: warm-up, overload, auth, a failing step, draining. Each test runs its own
server on the trained tiny model (token-id prompts; it counts, so every answer is checkable)."""

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.server.state import ServerSettings

from .conftest import ServerThread, http, sse_events, tiny_engine_factory


def counting_request(start: int, max_tokens: int, **extra) -> dict:
    return {"prompt": counting_sequence(start, 1)[:3], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}


def expected_text(start: int, max_tokens: int) -> str:
    return "".join(f" {start + 2 + i}" for i in range(max_tokens))


@pytest.fixture
def make_server(tiny_runner, tiny_trained):
    servers = []

    def make(factory=None, wait_ready=True, shutdown_timeout=10.0, **settings):
        server = ServerThread(factory or tiny_engine_factory(tiny_runner, tiny_trained),
                              ServerSettings(model_name="tiny", **settings), shutdown_timeout)
        servers.append(server)
        return server.start(wait_ready)

    yield make
    for server in servers:
        if server.running:
            server.stop()


def test_health_is_503_while_warming_up_then_200(make_server, tiny_runner, tiny_trained):
    release = threading.Event()
    build = tiny_engine_factory(tiny_runner, tiny_trained)

    def slow_factory():
        release.wait(60)
        return build()

    server = make_server(slow_factory, wait_ready=False)
    status, headers, raw = http(server, "GET", "/health")
    assert status == 503 and json.loads(raw)["status"] == "warming up" and "Retry-After" in headers
    status, headers, raw = http(server, "POST", "/v1/completions", counting_request(0, 3))
    assert status == 503 and "loading" in json.loads(raw)["error"]["message"] and "Retry-After" in headers
    release.set()
    for _ in range(200):
        if http(server, "GET", "/health")[0] == 200:
            break
        time.sleep(0.05)
    status, _, raw = http(server, "POST", "/v1/completions", counting_request(0, 3))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_text(0, 3)


def test_a_model_that_fails_to_load_makes_serve_exit_1(make_server):
    def broken_factory():
        raise RuntimeError("weights are corrupt")

    server = make_server(broken_factory, wait_ready=False)
    assert server.wait_exit(30) == 1


def test_overload_gives_fast_503_and_loses_no_admitted_request(make_server):
    server = make_server(max_queued_requests=4)  # capacity: 8 running + 4 waiting
    capacity = 12

    async def one(session, i):
        started = time.monotonic()
        async with session.post(server.url + "/v1/completions", json=counting_request(i % 4, 55)) as response:
            return i, response.status, dict(response.headers), await response.json(), time.monotonic() - started

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(40)))

    results = asyncio.run(main())
    admitted = [r for r in results if r[1] == 200]
    refused = [r for r in results if r[1] == 503]
    assert len(admitted) + len(refused) == 40 and len(refused) > 0 and len(admitted) >= capacity
    for i, _, _, body, _ in admitted:  # every admitted request finished, and right
        assert body["choices"][0]["text"] == expected_text(i % 4, 55)
    slowest_admitted = max(r[4] for r in admitted)
    for _, _, headers, body, seconds in refused:
        assert headers["Retry-After"] == "1" and "capacity" in body["error"]["message"]
        assert seconds < slowest_admitted  # refused at once, not after queueing
    assert server.engine.kv.num_free_pages == server.engine.kv.num_pages


def test_api_key(make_server):
    server = make_server(api_key="s3cret")
    request = counting_request(1, 2)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        status, got_headers, raw = http(server, "POST", "/v1/completions", request, headers)
        error = json.loads(raw)["error"]
        assert status == 401 and error["code"] == "invalid_api_key" and got_headers["WWW-Authenticate"] == "Bearer"
    assert http(server, "GET", "/v1/models")[0] == 401
    status, _, raw = http(server, "POST", "/v1/completions", request, {"Authorization": "Bearer s3cret"})
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_text(1, 2)
    assert http(server, "GET", "/health")[0] == 200  # probes need no key
    assert http(server, "GET", "/metrics")[0] == 200
    assert http(server, "GET", "/version")[0] == 200
    for path, body in (("/tokenize", {"prompt": "1 2"}), ("/detokenize", {"tokens": [64, 3, 4]})):
        assert http(server, "POST", path, body)[0] == 401, path  # the tokenizer endpoints need the key
    status, _, raw = http(server, "POST", "/detokenize", {"tokens": [64, 3, 4]}, {"Authorization": "Bearer s3cret"})
    assert status == 200 and json.loads(raw) == {"prompt": "<s> 3 4"}


def test_a_failing_step_fails_only_its_requests(make_server, monkeypatch):
    server = make_server()
    runner = server.engine.runner
    real_dispatch = runner.dispatch
    fail_after = []  # [n]: the step after n more good ones raises

    def flaky_dispatch(plan):
        if fail_after:
            if fail_after[0] == 0:
                fail_after.clear()
                raise RuntimeError("injected device fault")
            fail_after[0] -= 1
        return real_dispatch(plan)

    monkeypatch.setattr(runner, "dispatch", flaky_dispatch)
    fail_after.append(0)
    status, _, raw = http(server, "POST", "/v1/completions", counting_request(2, 5))
    error = json.loads(raw)["error"]
    assert status == 500 and "injected device fault" in error["message"] and error["type"] == "server_error"
    fail_after.append(0)  # before the stream's first chunk: still a plain 500
    status, _, raw = http(server, "POST", "/v1/completions", counting_request(2, 5, stream=True))
    assert status == 500 and "injected device fault" in json.loads(raw)["error"]["message"]
    fail_after.append(2)  # mid-stream: the status has gone out, so an error event, then [DONE]
    status, _, raw = http(server, "POST", "/v1/completions", counting_request(2, 5, stream=True))
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]" and "injected device fault" in events[-2]
    assert json.loads(events[0])["choices"][0]["text"] == " 4"
    # The server keeps serving, and the failed requests gave their pages back.
    status, _, raw = http(server, "POST", "/v1/completions", counting_request(3, 5))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected_text(3, 5)
    assert server.engine.kv.num_free_pages == server.engine.kv.num_pages


def test_drain_finishes_in_flight_requests_then_cancels_past_the_timeout(make_server, monkeypatch):
    server = make_server(shutdown_timeout=1.0)
    runner = server.engine.runner
    real_dispatch = runner.dispatch

    def slow_dispatch(plan):  # ~20 steps per second, so 100 tokens outlast the 1 s drain
        time.sleep(0.05)
        return real_dispatch(plan)

    monkeypatch.setattr(runner, "dispatch", slow_dispatch)

    async def main():
        async with aiohttp.ClientSession() as session:
            short = asyncio.ensure_future(session.post(server.url + "/v1/completions", json=counting_request(4, 5)))
            long = asyncio.ensure_future(session.post(server.url + "/v1/completions",
                                                      json=counting_request(5, 100, stream=True)))
            await asyncio.sleep(0.2)  # both are running
            stopping = asyncio.get_running_loop().run_in_executor(None, server.stop)
            short_response = await short
            short_body = await short_response.json()
            long_response = await long
            try:
                long_text = (await long_response.read()).decode()
            except aiohttp.ClientPayloadError:  # cut off mid-stream
                long_text = None
            return short_response.status, short_body, long_text, await stopping

    status, body, long_text, exit_code = asyncio.run(main())
    assert status == 200 and body["choices"][0]["text"] == expected_text(4, 5)  # finished within the timeout
    assert long_text is None or "[DONE]" not in long_text  # cancelled, not completed
    assert exit_code == 0
    assert server.engine.kv.num_free_pages == server.engine.kv.num_pages


def test_a_failing_step_spares_the_requests_it_did_not_schedule(make_server, monkeypatch):
    server = make_server()  # max_num_seqs 8: of 12 requests, 4 wait
    runner = server.engine.runner
    real_dispatch = runner.dispatch
    calls = []

    def dispatch(plan):
        calls.append(len(plan.request_ids))  # the rows it runs: one per scheduled request
        time.sleep(0.02)  # slow enough that all 12 requests have arrived before step 10
        if len(calls) == 10:
            raise RuntimeError("injected device fault")
        return real_dispatch(plan)

    monkeypatch.setattr(runner, "dispatch", dispatch)

    async def one(session, i):
        async with session.post(server.url + "/v1/completions", json=counting_request(i % 4, 30)) as response:
            return i, response.status, await response.json()

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(one(session, i) for i in range(12)))

    results = asyncio.run(main())
    assert calls[9] == 8  # the failing step ran the 8 admitted requests
    failed = [r for r in results if r[1] == 500]
    served = [r for r in results if r[1] == 200]
    assert len(failed) == 8 and all("injected device fault" in body["error"]["message"] for _, _, body in failed)
    assert len(served) == 4  # the waiting ones were not in that step: they finish, and right
    for i, _, body in served:
        assert body["choices"][0]["text"] == expected_text(i % 4, 30)
    assert server.engine.kv.num_free_pages == server.engine.kv.num_pages
