"""The OpenAI request schema, parsed into typed requests. No jax, no aiohttp. The fields that become
sampling parameters are read in sampling_fields.py, a chat's own in chat_fields.py, single typed
fields and the error answer in request_fields.py.

Every field of OpenAI's documented request bodies is known here, in one of three sets:
honoured (it changes what we do), accepted (harmless metadata we ignore, like `user`), or
unsupported (like `audio`: a 400 that says so, unless the client sent it empty or null). vLLM's
sampling and structured-output extensions are honoured too. Anything else is a 400 naming the field, so a typo such as
`max_token` never silently falls back to a default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orca_jax.sampling_params import SamplingParams
from orca_jax.server.chat_fields import read_messages, read_template_kwargs, read_tool_choice, read_tools
from orca_jax.server.request_fields import APIError, get_field, invalid, json_type, read_max_tokens  # noqa: F401
from orca_jax.server.sampling_fields import read_sampling_params, read_structured_options

# vLLM's extensions: benchmarks need fixed output lengths, users need the samplers llama.cpp has.
SAMPLING_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                       "skip_special_tokens", "include_stop_str_in_output",
                       # structured outputs: vLLM's newer object, and its older guided_* fields
                       "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"}
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
    if get_field(body, "suffix", str, "") != "":
        raise invalid("'suffix' (insertion) is not supported by this server; leave it out", "suffix")
    logprobs = get_field(body, "logprobs", int)
    echo = get_field(body, "echo", bool, False)
    if echo and logprobs is not None:
        raise invalid("'echo' with 'logprobs' would need prompt logprobs, which this server does not compute; "
                      "drop one of them", "echo")
    params = read_sampling_params(body, logprobs, max_tokens_default=16)
    best_of = get_field(body, "best_of", int)
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
    if get_field(body, "logprobs", bool, False):
        top_logprobs = get_field(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens_given = read_max_tokens(body) is not None
    params = read_sampling_params(body, top_logprobs, max_tokens_default=None)
    stream, include_usage, continuous_usage = _stream(body)
    tools = read_tools(body)
    tool_choice = read_tool_choice(body, tools)
    return ChatRequest(_model(body), read_messages(body), params, max_tokens_given, stream, include_usage,
                       continuous_usage, tools, tool_choice, get_field(body, "parallel_tool_calls", bool, True),
                       read_template_kwargs(body), read_structured_options(body).get("disable_additional_properties"))


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
        prompt = get_field(body, "prompt", str)
        return TokenizeRequest(_model(body), prompt, None, get_field(body, "add_special_tokens", bool), False)
    return TokenizeRequest(_model(body), None, read_messages(body), get_field(body, "add_special_tokens", bool),
                           get_field(body, "add_generation_prompt", bool, True), read_tools(body),
                           read_template_kwargs(body))


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


def _model(body: dict) -> str | None:
    return get_field(body, "model", str)


def _stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = get_field(body, "stream", bool, False)
    options = get_field(body, "stream_options", dict)
    if options is None:
        return stream, False, False
    if not stream:
        raise invalid("'stream_options' is only allowed with 'stream': true", "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise invalid(f"unknown stream_options {sorted(unknown)}; this server knows 'include_usage' and "
                      "'continuous_usage_stats'", "stream_options")
    include_usage = get_field(options, "include_usage", bool, False)
    continuous = get_field(options, "continuous_usage_stats", bool, False)
    if continuous and not include_usage:  # vLLM ignores it then; we say so instead
        raise invalid("stream_options.continuous_usage_stats needs 'include_usage': true as well",
                      "stream_options")
    return stream, include_usage, continuous


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


