"""The request schema without a server: every documented OpenAI field is known, honoured or refused
by name, and typed requests come out right."""

import pytest

from orca_jax.sampling_params import StructuredOutputsParams
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


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f"}]),
                                         ("audio", {"voice": "alloy"}), ("prediction", {"type": "content"}),
                                         ("reasoning_effort", "high"),
                                         ("web_search_options", {"search_context_size": "low"}),
                                         ("function_call", "auto"), ("store", True), ("modalities", ["audio"])])
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


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("body,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": "start: \"x\""}, StructuredOutputsParams(grammar="start: \"x\"")),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
])
def test_output_constraints_on_both_endpoints(body, expected):
    assert parse_chat({"messages": MESSAGES, **body}).params.structured_outputs == expected
    assert parse_completion({"prompt": "hi", **body}).params.structured_outputs == expected


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one output constraint"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": 3}, "guided_json", "JSON schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one output constraint"),
])
def test_bad_output_constraints(body, param, words):
    with pytest.raises(APIError) as error:
        parse_completion({"prompt": "hi", **body})
    assert error.value.param == param and words in error.value.message


def test_logit_bias_keys_become_token_ids():
    assert parse_completion({"prompt": "hi", "logit_bias": {"5": -100, "7": 2.5}}).params.logit_bias == {5: -100.0,
                                                                                                        7: 2.5}
    for bias, words in (({"5": -101}, "[-100, 100]"), ({"-5": 1}, "token ids"), ({"5": True}, "numbers"),
                        ({str(i): 1 for i in range(301)}, "at most 300")):
        with pytest.raises(APIError) as error:
            parse_chat({"messages": MESSAGES, "logit_bias": bias})
        assert error.value.param == "logit_bias" and words in error.value.message


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}


def test_tools_and_tool_messages_are_typed():
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    request = parse_chat({"messages": messages, "tools": [TOOL], "chat_template_kwargs": {"enable_thinking": False}})
    assert request.tools == [TOOL] and request.tool_choice == "auto" and request.parallel_tool_calls
    assert request.messages[1] == {"role": "assistant", "content": "", "tool_calls": messages[1]["tool_calls"]}
    assert request.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert parse_chat({"messages": MESSAGES}).tool_choice == "none"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_chat({"messages": MESSAGES, "tools": [TOOL], "tool_choice": named}).tool_choice == named
    with pytest.raises(APIError, match="not among the tools"):
        parse_chat({"messages": MESSAGES, "tools": [TOOL], "tool_choice": {"type": "function",
                                                                           "function": {"name": "nope"}}})
    with pytest.raises(APIError, match="tool_choice must be"):
        parse_chat({"messages": MESSAGES, "tools": [TOOL], "tool_choice": "sometimes"})
    with pytest.raises(APIError, match="unique"):
        parse_chat({"messages": MESSAGES, "tools": [TOOL, TOOL]})
