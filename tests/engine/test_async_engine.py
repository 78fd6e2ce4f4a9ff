"""The engine thread with asyncio callers: concurrency, cancellation, rejection, step failures."""

import asyncio
import contextlib
import threading

import pytest

from orca_jax.checkpoint.train_tiny import counting_sequence
from orca_jax.engine.async_engine import AsyncLLMEngine, EngineStepError
from orca_jax.engine.engine import RequestRejected
from orca_jax.sampling_params import SamplingParams

from .conftest import TINY_LIMITS, make_engine


@pytest.fixture
def async_engine(tiny_runner, tiny_trained):
    engine = AsyncLLMEngine(make_engine(tiny_runner, tiny_trained, "chunked", **TINY_LIMITS))
    yield engine
    engine.shutdown(timeout=30)


async def collect(async_engine, prompt, params, **kwargs):
    outputs = [out async for out in async_engine.generate(prompt, params, **kwargs)]
    return outputs


@contextlib.contextmanager
def held_after_the_first_token(async_engine):
    """Once a token has been generated (and delivered: delivery follows the step), the engine thread
    waits inside its next step, before collecting it, until `release` is set; `holding` says it
    waits. Whatever the test does meanwhile meets a request in flight, and the commands it posts
    wait in the inbox. Yields (holding, release)."""
    runner = async_engine.engine.runner
    real_collect, holding, release = runner.collect, threading.Event(), threading.Event()

    def held(pending):
        if async_engine.engine.num_generated_tokens and not release.is_set():
            holding.set()
            release.wait(30)
        return real_collect(pending)

    runner.collect = held
    try:
        yield holding, release
    finally:
        release.set()
        runner.collect = real_collect


def test_concurrent_requests_stream_and_finish_right(async_engine):
    prompts = [counting_sequence(i, 1 + i % 4)[:3] for i in range(12)]  # more than max_num_seqs

    async def main():
        return await asyncio.gather(*(collect(async_engine, p, SamplingParams(temperature=0, max_tokens=100))
                                      for p in prompts))

    results = asyncio.run(main())
    for prompt, outputs in zip(prompts, results):
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        tokens = outputs[-1].outputs[0].token_ids
        assert tokens == counting_sequence(prompt[1], prompt[2] - prompt[1])[3:]
        assert len(outputs) > 1  # it streamed
    assert async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages


def test_cancelling_the_iterator_aborts_and_frees_pages(async_engine):
    async def main():
        stream = async_engine.generate(counting_sequence(0, 1)[:3], SamplingParams(temperature=0, max_tokens=60,
                                                                                   ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()  # the client went away
        for _ in range(200):
            if async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages:
                break
            await asyncio.sleep(0.01)
        return first

    first = asyncio.run(main())
    assert not first.finished
    assert async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages
    assert not async_engine.engine.has_unfinished_requests()


def test_rejected_request_fails_only_itself(async_engine):
    async def main():
        bad = collect(async_engine, [64, 3, 5], SamplingParams(max_tokens=500))
        good = collect(async_engine, [64, 3, 5], SamplingParams(temperature=0, max_tokens=3))
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, RequestRejected) and "context length" in str(bad)
    assert good[-1].outputs[0].token_ids == [7, 9, 11]


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(async_engine):
    runner = async_engine.engine.runner
    real_dispatch = runner.dispatch
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real_dispatch(plan)

    runner.dispatch = flaky
    try:
        async def main():
            first = await asyncio.gather(collect(async_engine, [64, 3, 5], SamplingParams(temperature=0, max_tokens=20)),
                                         return_exceptions=True)
            second = await collect(async_engine, [64, 3, 5], SamplingParams(temperature=0, max_tokens=3))
            return first[0], second

        failed, served = asyncio.run(main())
    finally:
        runner.dispatch = real_dispatch
    assert isinstance(failed, EngineStepError) and "device fell over" in str(failed)
    assert served[-1].outputs[0].token_ids == [7, 9, 11]
    assert async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages


def test_idle_engine_runs_the_programs_warm_up_left(tiny_trained):
    """Warm-up runs only the smallest buckets' programs; a program's first run is slow (XLA:CPU
    builds its dot fusions' plans then), so the idle engine thread runs the others, before any
    request needs them. A fresh runner: the shared one has run every program already."""
    import time

    from ..conftest import warm_tiny_runner

    runner = warm_tiny_runner(tiny_trained, "xla")
    assert runner.run_first_runs(limit=0) == 1  # buckets (16 tokens, 4 rows) ran; (64, 8) did not
    ran = []
    run_plan = runner.run_plan
    runner.run_plan = lambda plan: (ran.append(plan.bucket), run_plan(plan))[1]
    engine = AsyncLLMEngine(make_engine(runner, tiny_trained, "chunked", **TINY_LIMITS))
    try:
        deadline = time.monotonic() + 120
        while runner.run_first_runs(limit=0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ran == [(64, 8)]  # no request was sent: the idle thread ran it, once

        async def main():  # and requests are served as before
            return await collect(engine, counting_sequence(2, 1)[:3], SamplingParams(temperature=0, max_tokens=5))

        assert asyncio.run(main())[-1].outputs[0].token_ids == counting_sequence(2, 1)[3:8]
    finally:
        engine.shutdown(timeout=30)


def test_a_closed_event_loop_drops_its_requests_and_the_engine_keeps_serving(async_engine):
    """A loop that closes with a request in flight (asyncio.run returning, a test's own loop) cannot
    take its outputs: the engine thread drops them and aborts the request, and serves the next loop."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with held_after_the_first_token(async_engine) as (_, release):
        loop = asyncio.new_event_loop()
        stream = async_engine.generate(counting_sequence(0, 1)[:3], params)
        first = loop.run_until_complete(stream.__anext__())
        loop.close()  # the stream left open: nothing tells the engine
        release.set()  # the step now delivers to the closed loop

        async def later():  # on a new loop: the engine thread must still be there
            return await asyncio.wait_for(collect(async_engine, [64, 3, 5], SamplingParams(temperature=0, max_tokens=3)),
                                          30)

        served = asyncio.run(later())
    assert not first.finished
    assert served[-1].outputs[0].token_ids == [7, 9, 11]
    assert not async_engine.engine.has_unfinished_requests()  # the abandoned request was aborted
    assert async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages


def test_a_duplicate_request_id_is_refused_and_the_live_request_goes_on(async_engine):
    """A second request under a live request's id fails its own iterator; the live request keeps its
    queue and runs to the end, even when the duplicate's client goes away before the refusal."""
    prompt = counting_sequence(2, 3)[:3]

    async def main():
        with held_after_the_first_token(async_engine) as (holding, release):
            live = async_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=100), request_id="same")
            outputs = [await live.__anext__()]
            assert await asyncio.to_thread(holding.wait, 30)  # the thread drains its inbox no more
            refused = asyncio.ensure_future(collect(async_engine, [64, 3, 5], SamplingParams(max_tokens=3),
                                                    request_id="same"))
            gone = asyncio.ensure_future(collect(async_engine, [64, 3, 5], SamplingParams(max_tokens=3),
                                                 request_id="same"))
            await asyncio.sleep(0.1)  # both posted (the engine holds them in its inbox)
            gone.cancel()  # its abort names "same" too
            release.set()
        outputs += await asyncio.wait_for(collect_rest(live), 30)
        return outputs, await asyncio.gather(refused, gone, return_exceptions=True)

    outputs, (refused, gone) = asyncio.run(main())
    assert isinstance(refused, ValueError) and "already in use" in str(refused)
    assert isinstance(gone, asyncio.CancelledError)
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids == counting_sequence(2, 3)[3:]
    assert async_engine.engine.kv.num_free_pages == async_engine.engine.kv.num_pages


async def collect_rest(stream):
    return [out async for out in stream]
