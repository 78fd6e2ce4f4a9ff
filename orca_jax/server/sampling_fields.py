"""A request's sampling fields into `SamplingParams`: OpenAI's, vLLM's extensions, the logit bias
and the one output constraint among response_format, structured_outputs and the guided_* fields.
No jax, no aiohttp.
"""

from __future__ import annotations

import re
from typing import Any

from orca_jax.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams
from orca_jax.server.request_fields import get_field, invalid, json_type, read_max_tokens

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
# Options beside a constraint, or alone: then they apply to response_format / guided_json, or to the
# arguments of a forced tool call.
STRUCTURED_OUTPUTS_OPTIONS = {"disable_additional_properties"}
MAX_N = 16  # samples per prompt; each one is a sequence in the batch


def read_sampling_params(body: dict, logprobs: int | None, max_tokens_default: int | None) -> SamplingParams:
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    n = get_field(body, "n", int, 1)
    if n > MAX_N:
        raise invalid(f"n={n} is above this server's maximum of {MAX_N} samples per prompt", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    stop_token_ids = get_field(body, "stop_token_ids", list, [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_token_ids):
        raise invalid("'stop_token_ids' must be a list of integers", "stop_token_ids")
    max_tokens = read_max_tokens(body)
    min_tokens = get_field(body, "min_tokens", int, 0)
    kwargs = dict(
        n=n, temperature=get_field(body, "temperature", float, 1.0), top_p=get_field(body, "top_p", float, 1.0),
        top_k=get_field(body, "top_k", int, 0), min_p=get_field(body, "min_p", float, 0.0),
        repetition_penalty=get_field(body, "repetition_penalty", float, 1.0),
        presence_penalty=get_field(body, "presence_penalty", float, 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", float, 0.0),
        seed=get_field(body, "seed", int),
        max_tokens=max_tokens if max_tokens is not None else (max_tokens_default or max(min_tokens, 1)),
        min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=get_field(body, "ignore_eos", bool, False), logprobs=logprobs,
        skip_special_tokens=get_field(body, "skip_special_tokens", bool, True),
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", bool, False),
        logit_bias=read_logit_bias(body), structured_outputs=read_structured_outputs(body),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as error:  # its messages start with the field's name
        message = str(error)
        field = re.match(r"[a-z_]*", message).group()
        if field == "max_tokens" and body.get("max_completion_tokens") is not None:
            field = "max_completion_tokens"
        raise invalid(message, field if field in body else None) from error


def read_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's {"token id as a string": bias}; the values' range is SamplingParams' to check."""
    bias = get_field(body, "logit_bias", dict)
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


def read_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The one output constraint among response_format, structured_outputs and the guided_* fields."""
    given: dict[str, tuple[str, Any]] = {}  # field -> (constraint kind, value)
    response_format = get_field(body, "response_format", dict)
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
    structured = get_field(body, "structured_outputs", dict)
    options = read_structured_options(body)
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


def read_structured_options(body: dict) -> dict:
    """structured_outputs' options that were given, checked (a 400 naming the option)."""
    structured = body.get("structured_outputs")
    options = {k: v for k, v in structured.items() if k in STRUCTURED_OUTPUTS_OPTIONS and v is not None} \
        if isinstance(structured, dict) else {}
    for name, value in options.items():
        if not isinstance(value, bool):
            raise invalid(f"structured_outputs.{name} must be true or false, got {json_type(value)}",
                          "structured_outputs")
    return options
