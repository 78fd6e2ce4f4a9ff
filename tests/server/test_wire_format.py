"""OpenAI wire format of every endpoint, on SmolLM2 behind a real server: field names and types, SSE
framing, finish reasons, usage counts; streamed text equals the non-streamed text; and the
official `openai` client works against it."""

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import http, sse_events

MESSAGES = [{"role": "user", "content": "Name three primary colors."}]


def post(server, path, body):
    status, headers, raw = http(server, "POST", path, body)
    assert status == 200, raw
    return headers, raw


def check_usage(usage, prompt_tokens, completion_tokens):
    assert usage == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                     "total_tokens": prompt_tokens + completion_tokens}


def test_completion_body(smollm2_server):
    prompt = "The capital of France is"
    _, raw = post(smollm2_server, "/v1/completions",
                  {"model": "smollm2", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    body = json.loads(raw)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "smollm2"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and isinstance(choice["text"], str)
    tokenizer = smollm2_server.engine.tokenizer
    check_usage(body["usage"], len(tokenizer.encode(prompt)), 8)
    assert tokenizer.encode(choice["text"])  # real text, not empty


def test_completion_stream_framing_and_text(smollm2_server):
    request = {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    _, whole = post(smollm2_server, "/v1/completions", request)
    headers, raw = post(smollm2_server, "/v1/completions",
                        {**request, "stream": True, "stream_options": {"include_usage": True}})
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    *text_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in text_chunks)
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == json.loads(whole)["choices"][0]["text"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == json.loads(whole)["usage"]


def test_completion_many_prompts_n_samples_and_echo(smollm2_server):
    body = json.loads(post(smollm2_server, "/v1/completions", {
        "prompt": ["Once upon a time", [504, 3575, 282]], "n": 2, "max_tokens": 5, "temperature": 0.8,
        "seed": 3, "echo": True})[1])
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][0]["text"].startswith("Once upon a time")
    decoded = smollm2_server.engine.tokenizer.decode([504, 3575, 282])
    assert body["choices"][2]["text"].startswith(decoded)
    assert body["usage"]["prompt_tokens"] == len(smollm2_server.engine.tokenizer.encode("Once upon a time")) + 3


def test_completion_logprobs(smollm2_server):
    body = json.loads(post(smollm2_server, "/v1/completions",
                           {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "logprobs": 3})[1])
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert value <= 0 and 1 <= len(top) <= 3
        assert top[token] == pytest.approx(value)  # greedy: the chosen token is the most likely one
        assert value == pytest.approx(max(top.values()))


def test_stop_string_streamed_equals_whole(smollm2_server):
    request = {"prompt": "1, 2, 3, 4,", "max_tokens": 30, "temperature": 0, "stop": [" 8"]}
    whole = json.loads(post(smollm2_server, "/v1/completions", request)[1])["choices"][0]
    assert whole["finish_reason"] == "stop" and " 8" not in whole["text"]
    events = sse_events(post(smollm2_server, "/v1/completions", {**request, "stream": True})[1])
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole["text"]


def test_chat_body(smollm2_server):
    body = json.loads(post(smollm2_server, "/v1/chat/completions",
                           {"model": "smollm2", "messages": MESSAGES, "max_completion_tokens": 40,
                            "temperature": 0, "user": "someone"})[1])
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and "Red" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    tokenizer = smollm2_server.engine.tokenizer
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert 0 < body["usage"]["completion_tokens"] <= 40


def test_chat_stream_order_role_content_finish_usage(smollm2_server):
    request = {"messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = json.loads(post(smollm2_server, "/v1/chat/completions", request)[1])
    events = sse_events(post(smollm2_server, "/v1/chat/completions",
                             {**request, "stream": True, "stream_options": {"include_usage": True}})[1])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    *choice_chunks, usage_chunk = chunks
    deltas = [c["choices"][0]["delta"] for c in choice_chunks]
    reasons = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert all(set(d) == {"content"} for d in deltas[1:-1])
    assert deltas[-1] == {} and reasons[-1] == whole["choices"][0]["finish_reason"]
    assert all(r is None for r in reasons[:-1])
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]


def test_chat_logprobs(smollm2_server):
    body = json.loads(post(smollm2_server, "/v1/chat/completions",
                           {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
                            "top_logprobs": 2})[1])
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for item in content:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        assert item["bytes"] == list(item["token"].encode())
        first, second = item["top_logprobs"]
        assert first["logprob"] >= second["logprob"]


def test_models_health_metrics(smollm2_server):
    status, _, raw = http(smollm2_server, "GET", "/v1/models")
    assert status == 200
    models = json.loads(raw)
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["smollm2"]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 2048
    assert json.loads(http(smollm2_server, "GET", "/v1/models/smollm2")[2])["id"] == "smollm2"
    assert http(smollm2_server, "GET", "/health")[:1] == (200,)
    status, headers, raw = http(smollm2_server, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    for name in ("orca_jax_num_requests_running", "orca_jax_num_requests_waiting", "orca_jax_kv_cache_usage",
                 "orca_jax_preemptions_total", "orca_jax_prompt_tokens_total", "orca_jax_generation_tokens_total",
                 "orca_jax_iteration_tokens_bucket", "orca_jax_time_to_first_token_seconds_bucket",
                 "orca_jax_inter_token_latency_seconds_bucket", "orca_jax_e2e_request_latency_seconds_bucket",
                 "orca_jax_request_queue_time_seconds_bucket", "orca_jax_compilations_after_warmup"):
        assert name in text, name
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["orca_jax_generation_tokens_total"] >= 8  # earlier tests in this module generated tokens
    assert samples["orca_jax_time_to_first_token_seconds_count"] >= 1
    assert samples["orca_jax_compilations_after_warmup"] == 0


def test_official_openai_client(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["smollm2"]
    completion = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 6 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="smollm2", messages=MESSAGES, tool_choice={
            "type": "function", "function": {"name": "g"}},
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
