"""The engine thread with asyncio callers: concurrency, cancellation, rejection, step failures."""

import asyncio

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


async def collect(async_engine, prompt, params):
    outputs = [out async for out in async_engine.generate(prompt, params)]
    return outputs


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
