"""A battery of bad requests: each gets the right 4xx as OpenAI-style JSON, and the server stays healthy."""

import json

import pytest

from .conftest import http

GOOD = {"model": "tiny", "prompt": [64, 3, 4], "max_tokens": 4, "temperature": 0}

BAD_COMPLETIONS = [
    # (case, body bytes or dict, status, param the error must name, words the message must contain)
    ("malformed JSON", b'{"prompt": [1, 2', 400, None, "not valid JSON"),
    ("body is a list", b"[1, 2, 3]", 400, None, "JSON object"),
    ("non-UTF-8", b'{"prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("unknown field", {**GOOD, "max_token": 3}, 400, "max_token", "unknown field"),
    ("unsupported suffix", {**GOOD, "suffix": "end"}, 400, "suffix", "not supported"),
    ("prompt_logprobs", {**GOOD, "prompt_logprobs": 1}, 400, "prompt_logprobs", "not supported"),
    ("logit_bias above 100", {**GOOD, "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    ("logit_bias key not a token id", {**GOOD, "logit_bias": {"five": 1}}, 400, "logit_bias", "token ids"),
    ("logit_bias value not a number", {**GOOD, "logit_bias": {"5": "x"}}, 400, "logit_bias", "numbers"),
    ("logit_bias token outside the vocabulary", {**GOOD, "logit_bias": {"99999": 1}}, 400, None, "vocabulary"),
    ("constraint on a tokenizer the grammar engine cannot read", {**GOOD, "guided_regex": "a"}, 400, None,
     "cannot read its tokenizer"),
    ("two constraints", {**GOOD, "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_choice", "one output"),
    ("unknown structured_outputs key", {**GOOD, "structured_outputs": {"jsn": {}}}, 400, "structured_outputs",
     "jsn"),
    ("best_of above n", {**GOOD, "best_of": 3}, 400, "best_of", "best_of"),
    ("max_tokens as string", {**GOOD, "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("max_tokens as bool", {**GOOD, "max_tokens": True}, 400, "max_tokens", "integer"),
    ("negative max_tokens", {**GOOD, "max_tokens": -3}, 400, "max_tokens", ">= 1"),
    ("huge max_tokens", {**GOOD, "max_tokens": 10**9}, 400, None, "context length of 128"),
    ("prompt too long", {**GOOD, "prompt": [5] * 200}, 400, None, "context length of 128"),
    ("temperature as string", {**GOOD, "temperature": "hot"}, 400, "temperature", "number"),
    ("negative temperature", {**GOOD, "temperature": -1}, 400, "temperature", "temperature"),
    ("top_p zero", {**GOOD, "top_p": 0}, 400, "top_p", "top_p"),
    ("stream as string", {**GOOD, "stream": "yes"}, 400, "stream", "boolean"),
    ("stream_options without stream", {**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("n too big", {**GOOD, "n": 1000}, 400, "n", "maximum"),
    ("logprobs too big", {**GOOD, "logprobs": 21}, 400, "logprobs", "20"),
    ("missing prompt", {"model": "tiny", "max_tokens": 3}, 400, "prompt", "required"),
    ("empty prompt list", {**GOOD, "prompt": []}, 400, "prompt", "non-empty"),
    ("empty string prompt", {**GOOD, "prompt": ""}, 400, "prompt", "empty"),
    ("mixed prompt list", {**GOOD, "prompt": [1, "a"]}, 400, "prompt", "token ids"),
    ("token out of vocabulary", {**GOOD, "prompt": [1, 99999]}, 400, None, "vocabulary"),
    ("stop_token_ids wrong type", {**GOOD, "stop_token_ids": ["a"]}, 400, "stop_token_ids", "integers"),
    ("min_tokens above max_tokens", {**GOOD, "min_tokens": 9}, 400, "min_tokens", "max_tokens"),
    ("seed negative", {**GOOD, "seed": -1}, 400, "seed", "seed"),
    ("text prompt without a usable vocabulary", {**GOOD, "prompt": "hello"}, 400, "prompt", "cannot be encoded"),
]

BAD_CHAT = [
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages", "non-empty"),
    ("messages not a list", {"model": "tiny", "messages": "hi"}, 400, "messages", "non-empty"),
    ("bad role", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "role"),
    ("image part", {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages", "text parts"),
    ("tool without a function", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                 "tools": [{"type": "function"}]}, 400, "tools", "tools[0]"),
    ("tool_choice names no tool", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                   "tools": [{"type": "function", "function": {"name": "f"}}],
                                   "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice", "'g', which is not among the tools ['f']"),
    ("tool_choice without tools", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                   "tool_choice": "required"}, 400, "tool_choice", "needs 'tools'"),
    ("tool message without its call id", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, 400,
     "messages", "tool_call_id"),
    ("unknown response_format type", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                      "response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
    ("reserved template variable", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                    "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs",
     "messages"),
    ("top_logprobs without logprobs", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                       "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("unknown field", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temprature": 0}, 400,
     "temprature", "unknown field"),
]


def check_error(status, body, expected_status, param, words):
    assert status == expected_status, body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize("case,body,status,param,words", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests(tiny_server, case, body, status, param, words):
    got, _, raw = http(tiny_server, "POST", "/v1/completions", body)
    check_error(got, raw, status, param, words)
    assert http(tiny_server, "GET", "/health")[0] == 200


@pytest.mark.parametrize("case,body,status,param,words", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests(tiny_server, case, body, status, param, words):
    got, _, raw = http(tiny_server, "POST", "/v1/chat/completions", body)
    check_error(got, raw, status, param, words)


def test_oversized_body_is_413(tiny_server):
    body = json.dumps({**GOOD, "prompt": [3] * 2000}).encode()  # the fixture's limit is 4096 bytes
    status, _, raw = http(tiny_server, "POST", "/v1/completions", body)
    check_error(status, raw, 413, None, "4096 bytes")


def test_unknown_model_is_404(tiny_server):
    status, _, raw = http(tiny_server, "POST", "/v1/completions", {**GOOD, "model": "gpt-4"})
    check_error(status, raw, 404, "model", "does not exist")
    assert json.loads(raw)["error"]["code"] == "model_not_found"
    status, _, raw = http(tiny_server, "GET", "/v1/models/gpt-4")
    check_error(status, raw, 404, "model", "does not exist")


def test_unknown_route_and_wrong_method_are_json_errors(tiny_server):
    status, _, raw = http(tiny_server, "GET", "/v1/nothing-here")
    check_error(status, raw, 404, None, "/v1/nothing-here")
    status, _, raw = http(tiny_server, "GET", "/v1/completions")
    check_error(status, raw, 405, None, "GET /v1/completions")


def test_a_good_request_still_works_after_the_battery(tiny_server):
    status, _, raw = http(tiny_server, "POST", "/v1/completions", GOOD)
    assert status == 200, raw
    body = json.loads(raw)
    assert body["choices"][0]["text"] == " 5 6 7 8" and body["usage"]["completion_tokens"] == 4
    assert tiny_server.engine.kv.num_free_pages == tiny_server.engine.kv.num_pages


def test_context_length_errors_carry_openais_code(tiny_server):
    status, _, raw = http(tiny_server, "POST", "/v1/completions", {**GOOD, "max_tokens": 10**9})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded"
