"""The OpenAI request schema, parsed into typed requests. No jax, no aiohttp.

Every field of OpenAI's documented request bodies is known here, in one of three sets:
honoured (it changes what we do), accepted (harmless metadata we ignore, like `user`), or
unsupported (like `audio`: a 400 that says so, unless the client sent it empty or null). vLLM's
sampling and structured-output extensions are honoured too. Anything else is a 400 naming the field, so a typo such as
`max_token` never silently falls back to a default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from orca_jax.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams

# vLLM's extensions: benchmarks need fixed output lengths, users need the samplers llama.cpp has.
SAMPLING_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                       "skip_special_tokens", "include_stop_str_in_output",
                       # structured outputs: vLLM's newer object, and its older guided_* fields
                       "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
# Options beside a constraint, or alone: then they apply to response_format / guided_json, or to the
# arguments of a forced tool call.
STRUCTURED_OUTPUTS_OPTIONS = {"disable_additional_properties"}
COMMON_HONOURED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
                   "stream_options", "stop", "presence_penalty", "frequency_penalty", "seed", "logit_bias",
                   "response_format"}

COMPLETION_HONOURED = COMMON_HONOURED | {"prompt", "logprobs", "echo", "best_of", "suffix"}
COMPLETION_ACCEPTED = {"user", "metadata"}
COMPLETION_UNSUPPORTED = {"prompt_logprobs"}  # vLLM's; needs logits at every prompt position (not computed)

CHAT_HONOURED = COMMON_HONOURED | {"messages", "logprobs", "top_logprobs", "modalities", "tools", "tool_choice",
                                   "parallel_tool_calls", "function_call", "store",
                                   "chat_template_kwargs"}  # the last one is vLLM's
CHAT_ACCEPTED = {"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
CHAT_UNSUPPORTED = {"functions", "audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"}

# vLLM's tokenizer endpoints: a text prompt, or chat messages rendered through the chat template.
TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
                   "chat_template_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}

TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # set by the server
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_N = 16  # samples per prompt; each one is a sequence in the batch


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # each a text or token ids; a choice per (prompt, sample)
    params: SamplingParams
    stream: bool
    include_usage: bool
    continuous_usage: bool  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    echo: bool


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]  # {"role", "content"} with content flattened to a string
    params: SamplingParams
    max_tokens_given: bool  # if not, the handler fills max_tokens with the rest of the context
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tools: list[dict] | None  # OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}
    tool_choice: str | dict  # "none", "auto", "required", or {"type": "function", "function": {"name"}}
    parallel_tool_calls: bool
    chat_template_kwargs: dict  # extra variables for the chat template (vLLM's)
    disable_additional_properties: bool | None = None  # structured_outputs' option, for forced tool calls


@dataclass
class TokenizeRequest:
    model: str | None
    prompt: str | None  # exactly one of prompt and messages
    messages: list[dict] | None
    add_special_tokens: bool | None  # None: as the generation endpoints tokenize (the tokenizer's BOS rule)
    add_generation_prompt: bool
    tools: list[dict] | None = None  # rendered into the prompt as chat renders them
    chat_template_kwargs: dict | None = None


@dataclass
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    _check_fields(body, COMPLETION_HONOURED, COMPLETION_ACCEPTED, COMPLETION_UNSUPPORTED, "/v1/completions")
    if _get(body, "suffix", str, "") != "":
        raise invalid("'suffix' (insertion) is not supported by this server; leave it out", "suffix")
    logprobs = _get(body, "logprobs", int)
    echo = _get(body, "echo", bool, False)
    if echo and logprobs is not None:
        raise invalid("'echo' with 'logprobs' would need prompt logprobs, which this server does not compute; "
                      "drop one of them", "echo")
    params = _sampling_params(body, logprobs, max_tokens_default=16)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != params.n:
        raise invalid(f"best_of={best_of} differs from n={params.n}; this server returns every sample, so "
                      "best_of must be left out or equal n", "best_of")
    stream, include_usage, continuous_usage = _stream(body)
    return CompletionRequest(_model(body), _prompts(body), params, stream, include_usage, continuous_usage, echo)


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    _check_fields(body, CHAT_HONOURED, CHAT_ACCEPTED, CHAT_UNSUPPORTED, "/v1/chat/completions")
    if body.get("function_call") not in (None, "none"):
        raise invalid("'function_call' (the deprecated form) is not supported; use 'tools' and 'tool_choice'",
                      "function_call")
    if body.get("store"):
        raise invalid("'store' is not supported: this server keeps no completions; leave it out or false", "store")
    if body.get("modalities") not in (None, ["text"]):
        raise invalid("only the 'text' modality is supported", "modalities")
    top_logprobs = None
    if _get(body, "logprobs", bool, False):
        top_logprobs = _get(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens_given = _max_tokens(body) is not None
    params = _sampling_params(body, top_logprobs, max_tokens_default=None)
    stream, include_usage, continuous_usage = _stream(body)
    tools = _tools(body)
    tool_choice = _tool_choice(body, tools)
    return ChatRequest(_model(body), _messages(body), params, max_tokens_given, stream, include_usage,
                       continuous_usage, tools, tool_choice, _get(body, "parallel_tool_calls", bool, True),
                       _template_kwargs(body), _structured_options(body).get("disable_additional_properties"))


def parse_tokenize(body: Any) -> TokenizeRequest:
    body = _object(body)
    _check_fields(body, TOKENIZE_FIELDS, set(), set(), "/tokenize")
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise invalid("give exactly one of 'prompt' (a string) and 'messages' (chat messages)",
                      None if has_prompt else "prompt")
    if has_prompt:
        for field in ("add_generation_prompt", "tools", "chat_template_kwargs"):
            if body.get(field) is not None:
                raise invalid(f"'{field}' applies to 'messages' only", field)
        prompt = _get(body, "prompt", str)
        return TokenizeRequest(_model(body), prompt, None, _get(body, "add_special_tokens", bool), False)
    return TokenizeRequest(_model(body), None, _messages(body), _get(body, "add_special_tokens", bool),
                           _get(body, "add_generation_prompt", bool, True), _tools(body), _template_kwargs(body))


def parse_detokenize(body: Any) -> DetokenizeRequest:
    body = _object(body)
    _check_fields(body, DETOKENIZE_FIELDS, set(), set(), "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid(f"'tokens' must be a list of token ids (integers), got {json_type(tokens)}", "tokens")
    for i, token in enumerate(tokens):
        if not _is_token(token):
            raise invalid(f"'tokens' must be a list of token ids (integers); tokens[{i}] is {json_type(token)}",
                          "tokens")
    return DetokenizeRequest(_model(body), tokens)


# ---- pieces --------------------------------------------------------------------------------
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_fields(body: dict, honoured: set, accepted: set, unsupported: set, endpoint: str) -> None:
    for field in sorted(body):
        if field in unsupported:
            if body[field] not in (None, [], {}):
                raise invalid(f"'{field}' is not supported by this server; leave it out", field)
        elif field not in honoured | accepted | SAMPLING_EXTENSIONS:
            raise invalid(f"unknown field '{field}' for {endpoint}; see the OpenAI API reference for the "
                          "fields it takes", field)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def _get(body: dict, field: str, kind: type, default: Any = None) -> Any:
    """The field's value checked against `kind` (null means absent). JSON has no int/float split,
    so a float field takes integers; booleans are never numbers."""
    value = body.get(field)
    if value is None:
        return default
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise invalid(f"'{field}' must be {_TYPE_NAMES[kind]}, got {json_type(value)}", field)
    return value


def json_type(value: Any) -> str:
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def _model(body: dict) -> str | None:
    return _get(body, "model", str)


def _max_tokens(body: dict) -> int | None:
    # max_completion_tokens is OpenAI's newer name; a client may send both, the new one wins.
    value = _get(body, "max_completion_tokens", int)
    return value if value is not None else _get(body, "max_tokens", int)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict)
    if options is None:
        return stream, False, False
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise invalid(f"unknown stream_options {sorted(unknown)}; this server knows 'include_usage' and "
                      "'continuous_usage_stats'", "stream_options")
    include_usage = _get(options, "include_usage", bool, False)
    continuous = _get(options, "continuous_usage_stats", bool, False)
    if continuous and not include_usage:  # vLLM ignores it then; we say so instead
        raise invalid("stream_options.continuous_usage_stats needs 'include_usage': true as well",
                      "stream_options")
    return stream, include_usage, continuous


def _sampling_params(body: dict, logprobs: int | None, max_tokens_default: int | None) -> SamplingParams:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    n = _get(body, "n", int, 1)
    if n > MAX_N:
        raise invalid(f"n={n} is above this server's maximum of {MAX_N} samples per prompt", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    stop_token_ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise invalid("'stop_token_ids' must be a list of integers", "stop_token_ids")
    max_tokens = _max_tokens(body)
    min_tokens = _get(body, "min_tokens", int, 0)
    kwargs = dict(
        n=n, temperature=_get(body, "temperature", float, 1.0), top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0), min_p=_get(body, "min_p", float, 0.0),
        repetition_penalty=_get(body, "repetition_penalty", float, 1.0),
        presence_penalty=_get(body, "presence_penalty", float, 0.0),
        frequency_penalty=_get(body, "frequency_penalty", float, 0.0),
        seed=_get(body, "seed", int),
        max_tokens=max_tokens if max_tokens is not None else (max_tokens_default or max(min_tokens, 1)),
        min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, False), logprobs=logprobs,
        skip_special_tokens=_get(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=_get(body, "include_stop_str_in_output", bool, False),
        logit_bias=_logit_bias(body), structured_outputs=_structured_outputs(body),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:  # its messages start with the field's name
        message = str(error)
        field = re.match(r"[a-z_]*", message).group()
        if field == "max_tokens" and body.get("max_completion_tokens") is not None:
            field = "max_completion_tokens"
        raise invalid(message, field if field in body else None) from error


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id as a string": bias}; the values' range is SamplingParams' to check."""
    bias = _get(body, "logit_bias", dict)
    if not bias:
        return None
    parsed = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]+", str(key)):
            raise invalid(f"logit_bias keys must be token ids (non-negative integers), got {key!r}", "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise invalid(f"logit_bias values must be numbers in [-100, 100]; token {key} has {json_type(value)}",
                          "logit_bias")
        parsed[int(key)] = float(value)
    return parsed


def _structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The one output constraint among response_format, structured_outputs and the guided_* fields."""
    given: dict[str, tuple[str, Any]] = {}  # field -> (constraint kind, value)
    response_format = _get(body, "response_format", dict)
    if response_format is not None:
        kind = response_format.get("type")
        if kind == "json_object":
            given["response_format"] = ("json_object", True)
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise invalid("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                              "{...}}}", "response_format")
            given["response_format"] = ("json", schema)
        elif kind != "text":
            raise invalid(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")
    for field, kind in GUIDED_FIELDS.items():
        if body.get(field) is not None:
            given[field] = (kind, body[field])
    structured = _get(body, "structured_outputs", dict)
    options = _structured_options(body)
    if structured:
        unknown = set(structured) - STRUCTURED_OUTPUTS_KEYS - STRUCTURED_OUTPUTS_OPTIONS
        if unknown:
            raise invalid(f"unknown structured_outputs keys {sorted(unknown)}; this server knows "
                          f"{sorted(STRUCTURED_OUTPUTS_KEYS | STRUCTURED_OUTPUTS_OPTIONS)}", "structured_outputs")
        for kind, value in structured.items():
            if kind in STRUCTURED_OUTPUTS_KEYS and value not in (None, False):
                given[f"structured_outputs.{kind}"] = (kind, value)
    if not given:
        return None
    if len(given) > 1:
        raise invalid(f"give one output constraint, got {sorted(given)}", sorted(given)[0].split(".")[0])
    (field, (kind, value)), = given.items()
    try:
        return StructuredOutputsParams(**{kind: value}, **options)
    except (TypeError, ValueError) as error:
        raise invalid(f"'{field}': {error}", field.split(".")[0]) from error


def _structured_options(body: dict) -> dict:
    """structured_outputs' options that were given, checked (a 400 naming the option)."""
    structured = body.get("structured_outputs")
    options = {k: v for k, v in structured.items() if k in STRUCTURED_OUTPUTS_OPTIONS and v is not None} \
        if isinstance(structured, dict) else {}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise invalid(f"structured_outputs.{name} must be true or false, got {json_type(value)}",
                          "structured_outputs")
    return options


def _template_kwargs(body: dict) -> dict:
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    reserved = sorted(set(kwargs) & TEMPLATE_VARIABLES)
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {reserved}: the server sets them from the request",
                      "chat_template_kwargs")
    return kwargs


def _tools(body: dict) -> list[dict] | None:
    tools = _get(body, "tools", list)
    if not tools:
        return None
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                          "\"parameters\": {...}}}", "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
    names = [tool["function"]["name"] for tool in tools]
    if len(set(names)) != len(names):
        raise invalid(f"tool names must be unique, got {names}", "tools")
    return tools


def _tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if not tools:
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if choice in ("auto", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise invalid(f"tool_choice names the function '{name}', which is not among the tools {names}", "tool_choice")
    return choice


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("'prompt' is required: a string, a list of token ids, or a list of either", "prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid("'prompt' must be a non-empty string, a list of token ids, or a non-empty list of either",
                      "prompt")
    if any(len(p) == 0 for p in prompts):
        raise invalid("a prompt is empty; give at least one character or token", "prompt")
    return prompts


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_token(t) for t in value)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    flattened = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object, got {json_type(message)}", "messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}", "messages")
        flat = {"role": "system" if role == "developer" else role, "content": _content_text(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls"):
            flat["tool_calls"] = _message_tool_calls(message["tool_calls"], i)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise invalid(f"messages[{i}] (role 'tool') needs 'tool_call_id', the id of the call it answers",
                              "messages")
            flat["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            flat["name"] = message["name"]
        flattened.append(flat)
    return flattened


def _message_tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls as OpenAI sends them (arguments: a JSON text)."""
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls must be a list", "messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)):
            raise invalid(f"messages[{i}].tool_calls[{j}] must be {{\"id\", \"type\": \"function\", "
                          "\"function\": {\"name\": ..., \"arguments\": \"<JSON text>\"}}", "messages")
    return calls


def _content_text(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (joined). Images and audio are refused."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise invalid(f"messages[{i}].content has a part of type {kind!r}; this server takes text parts "
                              "only", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts, got {json_type(content)}",
                  "messages")
