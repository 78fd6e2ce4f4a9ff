"""The request schema without a server: every documented OpenAI field is known, honoured or refused
by name, and typed requests come out right."""

import pytest

from orca_jax.server.protocol import APIError, parse_chat, parse_completion

# OpenAI's documented request fields (API reference, legacy completions and chat completions).
OPENAI_COMPLETION_FIELDS = ["model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
                            "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
                            "suffix", "temperature", "top_p", "user"]
OPENAI_CHAT_FIELDS = ["messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
                      "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "n",
                      "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "reasoning_effort",
                      "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
                      "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user",
                      "verbosity", "web_search_options"]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("field", OPENAI_COMPLETION_FIELDS)
def test_every_completion_field_is_known(field):
    body = {"prompt": "hi", field: None} if field != "prompt" else {"prompt": "hi"}
    parse_completion(body)  # null means "not given": never an unknown-field error


@pytest.mark.parametrize("field", OPENAI_CHAT_FIELDS)
def test_every_chat_field_is_known(field):
    body = {"messages": MESSAGES, field: None} if field != "messages" else {"messages": MESSAGES}
    parse_chat(body)


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function"}]), ("functions", [{"name": "f"}]),
                                         ("audio", {"voice": "alloy"}), ("prediction", {"type": "content"}),
                                         ("reasoning_effort", "high"),
                                         ("web_search_options", {"search_context_size": "low"}),
                                         ("tool_choice", "auto"), ("store", True), ("modalities", ["audio"])])
def test_unsupported_chat_fields_are_refused_by_name(field, value):
    with pytest.raises(APIError) as error:
        parse_chat({"messages": MESSAGES, field: value})
    assert error.value.status == 400 and error.value.param == field


def test_empty_unsupported_fields_mean_not_used():
    parse_chat({"messages": MESSAGES, "tools": [], "functions": [], "web_search_options": {}, "tool_choice": "none"})


def test_completion_request_is_typed():
    request = parse_completion({"prompt": ["a", [1, 2]], "max_tokens": 7, "temperature": 0, "n": 2, "best_of": 2,
                                "stop": "x", "top_k": 5, "ignore_eos": True, "min_tokens": 3, "stop_token_ids": [9],
                                "logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
                                "user": "u"})
    assert request.prompts == ["a", [1, 2]] and request.stream and request.include_usage
    p = request.params
    assert (p.max_tokens, p.temperature, p.n, p.stop, p.top_k, p.ignore_eos, p.min_tokens, p.stop_token_ids,
            p.logprobs) == (7, 0, 2, ["x"], 5, True, 3, [9], 2)


def test_chat_request_is_typed():
    request = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                         {"type": "text", "text": "brief"}]},
                                       {"role": "user", "content": "hi"}],
                          "max_completion_tokens": 9, "max_tokens": 100, "logprobs": True, "top_logprobs": 3})
    assert request.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert request.params.max_tokens == 9 and request.max_tokens_given  # the newer name wins
    assert request.params.logprobs == 3
    assert not parse_chat({"messages": MESSAGES}).max_tokens_given
