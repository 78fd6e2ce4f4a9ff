"""Structured outputs, logit_bias and tool calls through the real server on SmolLM2.

Every constrained output must parse and validate against its schema (jsonschema), whatever the
small model would have said unconstrained; that is the grammar's job, enforced by the token bitmask
on device. Requests run concurrently so they share batches, as in serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import re

import jsonschema
import openai
import pytest

from .conftest import http

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 16}
SCHEMAS = [  # 20 shapes: flat, nested, enums, bounded arrays, numbers, required and optional fields
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000}},
     "required": ["price"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": NAME},
        "required": ["id", "email"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"city": NAME, "country": {"enum": ["France", "Spain", "Italy"]},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
     "required": ["city", "country", "population"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"steps": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "do": NAME},
        "required": ["n", "do"], "additionalProperties": False}}}, "required": ["steps"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "confidence": {
        "type": "number", "minimum": 0, "maximum": 1}}, "required": ["answer", "confidence"],
     "additionalProperties": False},
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "sci-fi"]},
                                                 "maxItems": 2}},
     "required": ["title", "year", "genres"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -50, "maximum": 50}, "y": {"type": "integer", "minimum": -50,
                                                                       "maximum": 50}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 0,
                                                                            "maximum": 10}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"first": NAME, "last": NAME, "nickname": NAME},
     "required": ["first", "last"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "string", "maxLength": 8}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -40, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"],
     "additionalProperties": False},
    {"type": "object", "properties": {"order": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["sku", "qty"], "additionalProperties": False}},
        "express": {"type": "boolean"}}, "required": ["items", "express"], "additionalProperties": False}},
     "required": ["order"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 10},
                                      "scores": {"type": "array", "items": {"type": "number", "minimum": 0,
                                                                            "maximum": 10}, "maxItems": 3}},
     "required": ["name", "scores"], "additionalProperties": False},
]
PROMPT = "Describe a famous person, a city or an object as JSON."


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0)


def post(server, path: str, body: dict) -> dict:
    status, _, raw = http(server, "POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def test_json_schemas_validate(smollm2_server):
    """All 20 schemas at once (they share batches): half through chat's response_format, half through
    completions' guided_json. Each output is complete (stopped by its grammar) and validates."""
    def run(i: int) -> tuple[str, str]:
        schema = SCHEMAS[i]
        if i % 2 == 0:
            body = post(smollm2_server, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 80, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}})
            choice = body["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        body = post(smollm2_server, "/v1/completions", {"prompt": PROMPT + "\n", "max_tokens": 80, "temperature": 0,
                                                        "guided_json": schema})
        return body["choices"][0]["text"], body["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(len(SCHEMAS))))
    for schema, (text, finish_reason) in zip(SCHEMAS, results):
        assert finish_reason == "stop", (schema, text)  # ended by the grammar, not cut by max_tokens
        jsonschema.validate(json.loads(text), schema)
    assert smollm2_server.engine.runner.num_compilations_after_warmup == 0  # masks are arrays, never shapes


def test_json_object_and_sampled_outputs_parse(smollm2_server):
    body = post(smollm2_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Give me a JSON object about cats."}], "max_tokens": 80,
        "temperature": 0.8, "seed": 3, "n": 2, "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": SCHEMAS[1]}}})
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[1])
    body = post(smollm2_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What colour is the sky? Answer as JSON: {\"answer\": ...}"}],
        "max_tokens": 48, "temperature": 0, "response_format": {"type": "json_object"}})
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


def test_regex_choice_and_grammar(smollm2_server):
    def completion(**constraint) -> str:
        body = post(smollm2_server, "/v1/completions", {"prompt": "The answer is", "max_tokens": 24,
                                                        "temperature": 0, "logprobs": 0, **constraint})
        choice = body["choices"][0]
        assert choice["finish_reason"] == "stop", body
        # Stopped where the grammar ended, without spending a step on EOS.
        assert "<|im_end|>" not in choice["logprobs"]["tokens"], choice["logprobs"]["tokens"]
        return choice["text"]

    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", completion(guided_regex=r" [0-9]{3}-[0-9]{4}"))
    assert completion(guided_choice=["yes", "no"]) in ("yes", "no")
    assert completion(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"(ab)+!", completion(guided_grammar='start: ("ab")+ "!"'))
    assert re.fullmatch(r"x[0-9]y", completion(guided_grammar='root ::= "x" [0-9] "y"'))  # GBNF


def test_constrained_and_free_requests_in_one_batch_equal_their_solo_runs(smollm2_server):
    constrained = {"prompt": "My favourite colour is", "max_tokens": 12, "temperature": 0,
                   "guided_json": SCHEMAS[1]}
    free = {"prompt": "My favourite colour is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    solo = [post(smollm2_server, "/v1/completions", body)["choices"][0]["text"] for body in (constrained, free)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda body: post(smollm2_server, "/v1/completions", body)["choices"][0]["text"],
                                 [constrained, free, constrained, free]))
    assert together == solo * 2
    assert json.loads(solo[0])["color"] in ("red", "green", "blue") and not solo[1].startswith("{")


def test_logit_bias_bans_and_forces(smollm2_server):
    tokenizer = smollm2_server.engine.tokenizer
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    plain = post(smollm2_server, "/v1/completions", {**body, "logprobs": 0})["choices"][0]
    first = tokenizer.encode(plain["logprobs"]["tokens"][0])[0]
    banned = post(smollm2_server, "/v1/completions", {**body, "logit_bias": {str(first): -100}})["choices"][0]
    assert not banned["text"].startswith(plain["logprobs"]["tokens"][0])
    forced_token = tokenizer.encode(" banana")[0]
    forced = post(smollm2_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
        "logit_bias": {str(forced_token): 100}})["choices"][0]
    assert forced["message"]["content"] == tokenizer.decode([forced_token] * 3)


def test_bad_constraints_are_400_naming_the_problem(smollm2_server):
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    cases = [({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "Invalid type: strin"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                 "if": {"type": "string"}, "then": {"type": "string"}}}}}, "Unimplemented keys: [\"if\", \"then\"]"),
             ({"guided_regex": "a(b"}, "unclosed group"),
             ({"guided_grammar": "start: foo"}, "unknown name"),
             ({"logit_bias": {"49152": 5}}, "vocabulary")]
    for constraint, words in cases:
        for path, body in (("/v1/completions", {"prompt": "x", "max_tokens": 2}), ("/v1/chat/completions", chat)):
            status, _, raw = http(smollm2_server, "POST", path, {**body, **constraint})
            assert status == 400 and words in json.loads(raw)["error"]["message"], raw
    status, _, raw = http(smollm2_server, "POST", "/v1/chat/completions", {
        **chat, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}})
    assert status == 400 and "'get_wether', which is not among the tools" in json.loads(raw)["error"]["message"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Adds two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def check_calls(message, allowed: list[dict], cut: bool = False) -> None:
    """Each call validates; with `cut` (finish_reason "length") the last one holds the arguments as
    far as max_tokens let them go."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in allowed}
    assert message.tool_calls
    for call in message.tool_calls[:-1] if cut else message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_calls(client):
    # One call (SmolLM2, left to make parallel calls, repeats them until max_tokens).
    required = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, max_tokens=64, temperature=0)
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    check_calls(required.choices[0].message, TOOLS)
    # Parallel calls (the default): every complete call validates; one that max_tokens cut is still a call.
    parallel = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=64, temperature=0)
    check_calls(parallel.choices[0].message, TOOLS, cut=parallel.choices[0].finish_reason == "length")
    named = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["add"]
    check_calls(named.choices[0].message, [ADD])


def test_streamed_tool_calls_concatenate_to_the_whole_response(client):
    kwargs = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert finish_reason == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_multi_turn_with_a_tool_result(client, smollm2_server):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=64,
                                           temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    conversation = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    second = client.chat.completions.create(model="smollm2", messages=conversation, tools=[WEATHER], max_tokens=24,
                                            temperature=0, tool_choice="none")
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The call and its result are in the prompt the model saw (Hermes form, SmolLM2's template has no tools),
    # and /tokenize with the same tools counts what chat counted.
    tokenizer = smollm2_server.engine.tokenizer
    tokens = post(smollm2_server, "/tokenize", {"messages": conversation, "tools": [WEATHER]})["tokens"]
    assert len(tokens) == second.usage.prompt_tokens
    assert tokenizer.decode(tokens).endswith(
        "<|im_start|>assistant\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": json.loads(
            call.function.arguments)}) + "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n22 degrees "
        "and sunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in tokenizer.decode(tokens)


def test_chat_template_override_and_kwargs(smollm2_server):
    """--chat-template (the server's setting) replaces the model's template; chat_template_kwargs reach it."""
    state = smollm2_server.state
    original = state.settings
    state.settings = dataclasses.replace(original, chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}"
                                                                 "\n{% endfor %}{{ tail | default('A:') }}")
    try:
        request = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                   "chat_template_kwargs": {"tail": "Bot says:"}}
        usage = post(smollm2_server, "/v1/chat/completions", request)["usage"]
        tokens = post(smollm2_server, "/tokenize", {"messages": request["messages"],
                                                    "chat_template_kwargs": {"tail": "Bot says:"}})["tokens"]
    finally:
        state.settings = original
    assert smollm2_server.engine.tokenizer.decode(tokens) == "user: Hi\nBot says:"
    assert usage["prompt_tokens"] == len(tokens)


# Issue 17: schemas that do not say additionalProperties. SmolLM2 used to invent keys
# ("population_density_by_year": ...) until max_tokens cut the JSON; by default only listed keys are
# generated now. Arrays are bounded only where the schema bounds them (maxItems below), as written.
TOWN = "Answer in JSON about a small town by the sea."
OPEN_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
     "required": ["name", "population"]},
    {"type": "object", "properties": {"town": {"type": "object", "properties": {
        "name": {"type": "string"}, "country": {"type": "string"}}, "required": ["name"]},
        "beaches": {"type": "integer"}}, "required": ["town"]},
    {"type": "object", "properties": {"attractions": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "kind": {"enum": ["beach", "museum", "harbour"]}},
        "required": ["name", "kind"]}}}, "required": ["attractions"]},
    {"type": "object", "properties": {"climate": {"enum": ["mild", "cold", "hot"]}, "has_port": {"type": "boolean"}}},
    {"type": "object", "properties": {"name": {"type": "string"}, "nickname": {"type": "string"},
                                      "founded": {"type": "integer"}}, "required": ["name"]},
    {"type": "object", "properties": {"mayor": {"type": "object", "properties": {
        "name": {"type": "string"}, "party": {"enum": ["blue", "green"]}}}}, "required": ["mayor"]},
    {"type": "object", "properties": {"streets": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                                      "hills": {"type": "integer"}}, "required": ["streets"]},
    {"type": "object", "properties": {"boats": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"kind": {"type": "string"}, "count": {"type": "integer"}},
        "required": ["kind"]}}}, "required": ["boats"]},
    {"type": "object", "$defs": {"place": {"type": "object", "properties": {"name": {"type": "string"}}}},
     "properties": {"harbour": {"$ref": "#/$defs/place"}, "lighthouse": {"$ref": "#/$defs/place"}},
     "required": ["harbour"]},
    {"type": "object", "properties": {"weather": {"anyOf": [
        {"type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]},
        {"type": "string"}]}, "rating": {"type": "number"}}, "required": ["weather"]},
    # Unbounded numbers: SmolLM2 wrote "population": 1000000000... (then, with the integer part
    # bounded, "area_km2": 1200000000000000.000000000000...) until max_tokens.
    {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}}},
    {"type": "object", "properties": {"name": {"type": "string"}, "area_km2": {"type": "number"}}},
]


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def listed_keys_only(value, schema: dict, root: dict | None = None) -> bool:
    """Every object in `value` carries only keys its (sub)schema lists (anyOf: its first alternative)."""
    root = root or schema
    schema = root["$defs"][schema["$ref"].split("/")[-1]] if "$ref" in schema else schema.get("anyOf", [schema])[0]
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        return set(value) <= set(properties) and all(listed_keys_only(v, properties[k], root)
                                                     for k, v in value.items())
    if isinstance(value, list):
        return all(listed_keys_only(v, schema["items"], root) for v in value)
    return True


def chat_at_once(server, requests: list[dict]) -> list:
    """Chat completions sent together through the async client (so the engine batches them): choices."""
    async def everything():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        async with client:
            replies = await asyncio.gather(*[client.chat.completions.create(model="smollm2", temperature=0, **r)
                                             for r in requests])
        return [reply.choices[0] for reply in replies]

    return asyncio.run(everything())


def test_schemas_without_additional_properties_close(smollm2_server):
    """The issue's figure: each open schema (10, and 2 with unbounded numbers) closes (finish "stop")
    within 160 tokens at temperature 0 with only the listed keys; one more, cut by max_tokens, says
    "length"."""
    ask = [{"messages": [{"role": "user", "content": TOWN}], "max_tokens": 160,
            "response_format": json_schema_format(schema)} for schema in OPEN_SCHEMAS]
    *choices, cut = chat_at_once(smollm2_server, ask + [{**ask[0], "max_tokens": 6}])
    for schema, choice in zip(OPEN_SCHEMAS, choices):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        value = json.loads(choice.message.content)
        jsonschema.validate(value, schema)
        assert listed_keys_only(value, schema), (schema, value)
    assert cut.finish_reason == "length" and not cut.message.content.endswith("}")


def test_lenient_option_allows_invented_properties(client):
    """structured_outputs.disable_additional_properties false (vLLM's option) restores JSON Schema's
    letter: SmolLM2 goes on past the listed keys."""
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": TOWN}], max_tokens=24, temperature=0,
        response_format=json_schema_format(OPEN_SCHEMAS[0]),
        extra_body={"structured_outputs": {"disable_additional_properties": False}})
    keys = set(re.findall(r'"(\w+)": ', reply.choices[0].message.content))
    assert keys - {"name", "population"}, reply.choices[0].message.content


JSON_OBJECT_PROMPTS = [TOWN, "Describe your favourite book as JSON.", "Give me a JSON object about cats.",
                       "List three fruits and their colours in JSON.", "Describe a sunny day as a JSON object."]


def test_json_object_closes(smollm2_server):
    """json_object is bounded (engine/json_schema.py): 5 prompts each give a parsed object within 80
    tokens (unbounded, 0 of them did)."""
    for choice in chat_at_once(smollm2_server, [{"messages": [{"role": "user", "content": p}], "max_tokens": 80,
                                                 "response_format": {"type": "json_object"}}
                                                for p in JSON_OBJECT_PROMPTS]):
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_structured_outputs_option_of_the_wrong_type_is_400(smollm2_server):
    status, _, raw = http(smollm2_server, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": {"type": "json_object"},
        "structured_outputs": {"disable_additional_properties": "no"}})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "structured_outputs", raw
    assert "disable_additional_properties must be true or false, got a string" in error["message"]


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time",
                                             "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_call_of_a_tool_without_parameters(client, tool_choice):
    """Arguments `{}` (vLLM #28806 dropped them), streamed as whole; SmolLM2 used to fill the empty
    `properties` with invented ones until max_tokens, and the call came back as content."""
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": "What time is it?"}], tools=[GET_TIME],
                  tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=48, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("get_time", "{}")]
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            assert not choice.delta.content, choice
            streamed += [(d.function.name, d.function.arguments) for d in choice.delta.tool_calls or []]
    assert streamed == [("get_time", "{}")]


def test_forced_call_cut_by_max_tokens_is_still_a_call(client):
    """A forced call is never plain text: cut by max_tokens, it comes back as a call with the
    arguments as far as they got, and finish_reason "length" (as OpenAI does)."""
    reply = client.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER], max_tokens=20,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city"')
