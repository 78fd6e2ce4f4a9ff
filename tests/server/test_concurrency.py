"""Many clients at once, and clients that leave: SmolLM2 behind a real server."""

import asyncio
import json
import time

import aiohttp

from orca_jax.sampling_params import SamplingParams

from ..engine.conftest import SMOLLM2_LIMITS, make_engine, run_all

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
             "Explain a hash table in one sentence.", "Suggest a name for a robot.", "What causes rain?",
             "Say hello in Spanish.", "Give me a synonym for happy."]


async def stream_chat(session, url, question, max_tokens):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        text, usage, finish = "", None, None
        async for line in response.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"]:
                text += chunk["choices"][0]["delta"].get("content", "")
                finish = chunk["choices"][0]["finish_reason"] or finish
            else:
                usage = chunk["usage"]
        return text, usage, finish


def test_64_concurrent_streams_equal_the_offline_engine(smollm2_server, smollm2_runner, smollm2):
    tokenizer = smollm2.tokenizer
    requests = [(QUESTIONS[i % len(QUESTIONS)], 6 + (i * 7) % 20) for i in range(64)]

    async def main():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(stream_chat(session, smollm2_server.url, q, m) for q, m in requests))

    results = asyncio.run(main())
    # The same requests through an offline engine on the same runner (the server is idle now).
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q, _ in requests]
    offline = run_all(make_engine(smollm2_runner, smollm2, "chunked", **SMOLLM2_LIMITS),
                      [(p, SamplingParams(temperature=0, max_tokens=m)) for p, (_, m) in zip(prompts, requests)])
    for (text, usage, finish), expected, prompt in zip(results, offline, prompts):
        completion = expected.outputs[0]
        assert text == completion.text
        assert finish == completion.finish_reason
        assert usage == {"prompt_tokens": len(prompt), "completion_tokens": len(completion.token_ids),
                         "total_tokens": len(prompt) + len(completion.token_ids)}
    engine = smollm2_server.engine
    assert engine.kv.num_free_pages == engine.kv.num_pages


def wait_until_idle(server, timeout=30):
    engine = server.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.kv.num_free_pages == engine.kv.num_pages and not engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_mid_stream_frees_pages(smollm2_server):
    body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    steps_before = smollm2_server.state.engine.stats.num_steps

    async def main():
        async with aiohttp.ClientSession() as session:
            response = await session.post(smollm2_server.url + "/v1/completions", json=body)
            chunks = 0
            async for line in response.content:
                chunks += line.startswith(b"data: ")
                if chunks == 3:
                    break
            assert smollm2_server.engine.kv.num_used_pages > 0  # it is running and holds pages
            response.close()  # the client vanishes mid-stream

    registry = smollm2_server.state.metrics.registry
    cancelled_before = registry.get_sample_value("orca_jax_requests_total", {"outcome": "cancelled"}) or 0
    asyncio.run(main())
    assert wait_until_idle(smollm2_server)
    # Aborted long before its 1500 tokens, and counted as cancelled.
    assert smollm2_server.state.engine.stats.num_steps - steps_before < 200
    assert registry.get_sample_value("orca_jax_requests_total", {"outcome": "cancelled"}) == cancelled_before + 1


def test_disconnect_while_waiting_for_a_whole_response_frees_pages(smollm2_server):
    body = {"prompt": "Count to a thousand.", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    steps_before = smollm2_server.state.engine.stats.num_steps

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            try:
                await session.post(smollm2_server.url + "/v1/completions", json=body)
            except asyncio.TimeoutError:
                return True
        return False

    assert asyncio.run(main()), "the request should still have been running when the client gave up"
    assert wait_until_idle(smollm2_server)
    assert smollm2_server.state.engine.stats.num_steps - steps_before < 500  # aborted, not run to 1500
