"""vLLM's extra endpoints and options behind a real server: /tokenize, /detokenize, /version,
stream_options.continuous_usage_stats, the request log, the prefix-cache counters in /metrics, and
`metadata` on both generation endpoints. The tokenizer endpoints run on SmolLM2 (a real tokenizer and
chat template); the rest on the tiny model, with prefix caching and the request log on."""

import importlib.metadata
import json
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orca_jax.engine.async_engine import AsyncLLMEngine
from orca_jax.server.state import ServerSettings

from ..engine.conftest import TINY_LIMITS, make_engine
from .conftest import ServerThread, http, sse_events

MESSAGES = [{"role": "user", "content": "Name three primary colors."}]
REQUEST_LOG = "orca_jax.server.requests"


@pytest.fixture(scope="module")
def tiny_cached_server(tiny_runner, tiny_trained):
    """The tiny model with prefix caching and the request log on."""
    factory = lambda: AsyncLLMEngine(make_engine(tiny_runner, tiny_trained, "chunked", prefix_caching=True,  # noqa: E731
                                                 **TINY_LIMITS))
    server = ServerThread(factory, ServerSettings(model_name="tiny", enable_request_log=True)).start()
    yield server
    assert server.stop() == 0


def post(server, path, body):
    status, _, raw = http(server, "POST", path, body)
    assert status == 200, raw
    return json.loads(raw) if not raw.startswith(b"data: ") else raw


def metric_samples(server) -> dict:
    text = http(server, "GET", "/metrics")[2].decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


# ---- /tokenize, /detokenize, /version -----------------------------------------------------------
def test_tokenize_a_prompt(smollm2_server):
    tokenizer = smollm2_server.engine.tokenizer
    prompt = "The capital of France is"
    body = post(smollm2_server, "/tokenize", {"model": "smollm2", "prompt": prompt})
    assert body == {"count": len(tokenizer.encode(prompt)), "max_model_len": 2048, "tokens": tokenizer.encode(prompt)}
    with_bos = post(smollm2_server, "/tokenize", {"prompt": prompt, "add_special_tokens": True})
    assert with_bos["tokens"] == [tokenizer.bos_token_id] + body["tokens"] and with_bos["count"] == body["count"] + 1


def test_tokenize_messages_counts_what_chat_completions_counts(smollm2_server):
    tokenizer = smollm2_server.engine.tokenizer
    body = post(smollm2_server, "/tokenize", {"messages": MESSAGES})
    assert body["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(MESSAGES))
    chat = post(smollm2_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert body["count"] == chat["usage"]["prompt_tokens"]
    without = post(smollm2_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert without["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False))
    assert without["count"] < body["count"] and body["tokens"][:without["count"]] == without["tokens"]


def test_detokenize_round_trip(smollm2_server):
    text = "def fibonacci(n):\n    return n"
    tokens = post(smollm2_server, "/tokenize", {"prompt": text})["tokens"]
    assert post(smollm2_server, "/detokenize", {"model": "smollm2", "tokens": tokens}) == {"prompt": text}
    assert post(smollm2_server, "/detokenize", {"tokens": []}) == {"prompt": ""}


BAD_TOKENIZER_REQUESTS = [
    # (path, body, status, param the error names, words its message has)
    ("/tokenize", {"prompt": "hi", "add_special_token": True}, 400, "add_special_token", "unknown field"),
    ("/tokenize", {"prompt": "hi", "messages": MESSAGES}, 400, None, "exactly one"),
    ("/tokenize", {"model": "smollm2"}, 400, "prompt", "exactly one"),
    ("/tokenize", {"prompt": [1, 2]}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt", "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
    ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/tokenize", b"[1, 2]", 400, None, "JSON object"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "list of token ids"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens", "tokens[1] is a string"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "tokens[1] is a boolean"),
    ("/detokenize", {}, 400, "tokens", "got null"),
    ("/detokenize", {"tokens": [1, 49152, -1]}, 400, "tokens", "[49152, -1] are outside the vocabulary [0, 49152)"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt", "unknown field"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_TOKENIZER_REQUESTS,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_TOKENIZER_REQUESTS)])
def test_tokenizer_endpoints_refuse_bad_input(smollm2_server, path, body, status, param, words):
    got, _, raw = http(smollm2_server, "POST", path, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"], error
    assert error["param"] == param


def test_version(smollm2_server):
    status, _, raw = http(smollm2_server, "GET", "/version")
    assert status == 200 and json.loads(raw) == {"version": importlib.metadata.version("orca-jax")}


# ---- stream_options.continuous_usage_stats --------------------------------------------------------
def test_continuous_usage_stats_on_completions(tiny_cached_server):
    request = {"prompt": [64, 3, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(tiny_cached_server, "/v1/completions", request))
    *text_chunks, usage_chunk = [json.loads(e) for e in events[:-1]]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in text_chunks]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in text_chunks)
    assert all(c["usage"]["total_tokens"] == 3 + n for c, n in zip(text_chunks, counts))
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] == 6


def test_continuous_usage_stats_on_chat(smollm2_server):
    request = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = [json.loads(e) for e in sse_events(post(smollm2_server, "/v1/chat/completions", request))[:-1]]
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert chunks[0]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in chunks)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length" and chunks[-2]["usage"]["completion_tokens"] == 8


def test_continuous_usage_stats_without_include_usage_is_refused(tiny_cached_server):
    status, _, raw = http(tiny_cached_server, "POST", "/v1/completions", {
        "prompt": [64, 3, 4], "max_tokens": 2, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "stream_options" and "continuous_usage_stats" in error["message"]


# ---- metadata, the request log, prefix-cache counters ------------------------------------------------
def test_metadata_is_accepted_on_both_endpoints(tiny_cached_server, smollm2_server):
    body = post(tiny_cached_server, "/v1/completions", {"prompt": [64, 3, 4], "max_tokens": 1,
                                                        "metadata": {"team": "a"}})
    assert body["usage"]["completion_tokens"] == 1
    body = post(smollm2_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                         "metadata": {"team": "a"}})
    assert body["usage"]["completion_tokens"] == 1


def request_log_lines(caplog, count: int) -> list[str]:
    """The request log's lines; a stream's line comes just after its last byte, so wait for it."""
    for _ in range(100):
        lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG]
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    return lines


def test_request_log_one_line_per_request_without_the_text(tiny_cached_server, caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOG)
    body = post(tiny_cached_server, "/v1/completions",
                {"prompt": [64, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    post(tiny_cached_server, "/v1/completions", {"prompt": [64, 3, 4], "max_tokens": 2, "stream": True,
                                                 "ignore_eos": True})
    status, _, _ = http(tiny_cached_server, "POST", "/v1/completions", {"prompt": "zebra secret", "max_tokens": 2})
    assert status == 400
    http(tiny_cached_server, "GET", "/health")  # probes are not logged
    whole, streamed, refused = request_log_lines(caplog, 3)
    assert whole.startswith(f"{body['id']} POST /v1/completions 200 prompt_tokens=3 completion_tokens=4 latency=")
    assert streamed.startswith("cmpl-") and " 200 prompt_tokens=3 completion_tokens=2 latency=" in streamed
    assert refused.startswith("- POST /v1/completions 400 prompt_tokens=0 completion_tokens=0 latency=")
    assert "zebra" not in caplog.text
    assert len(request_log_lines(caplog, 4)) == 3


def test_request_log_is_off_by_default(smollm2_server, caplog):
    caplog.set_level(logging.INFO, logger=REQUEST_LOG)
    post(smollm2_server, "/tokenize", {"prompt": "hi"})
    assert request_log_lines(caplog, 1) == []


def test_prefix_cache_counters(tiny_cached_server):
    prompt = [64] + list(range(40, 51))  # 12 tokens: 3 pages of 4, unlike any earlier prompt or output
    request = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "n": 1}
    before = metric_samples(tiny_cached_server)
    post(tiny_cached_server, "/v1/completions", request)
    first = metric_samples(tiny_cached_server)
    post(tiny_cached_server, "/v1/completions", request)
    second = metric_samples(tiny_cached_server)
    queries, hits = "orca_jax_prefix_cache_queries_total", "orca_jax_prefix_cache_hits_total"
    assert first[queries] - before[queries] == 12 and first[hits] == before[hits]  # nothing cached yet
    assert second[queries] - first[queries] == 12
    assert 8 <= second[hits] - first[hits] < 12  # whole pages, and at least one token computed
