"""JSON schemas rewritten before llguidance compiles them. No jax.

JSON Schema lets an object carry any key its schema does not forbid, and llguidance follows the
letter of that (none of its compile options changes it): given a schema without
`"additionalProperties": false`, a small model invents keys (`"population_growth_rate_per_year"`)
until `max_tokens` cuts the JSON. xgrammar, vLLM's default engine, generates only the keys a schema
lists unless the schema allows more, and users of small models rely on that. `close_objects` makes
llguidance do the same; `"additionalProperties": true` or a schema for them keeps an object open.
It also gives numbers without bounds JSON's interoperable range and at most 9 decimals, so
their digits end.
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
ONE_SCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else")
SCHEMA_LISTS = ("items", "prefixItems")  # items is a list in drafts before 2020-12
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
COMBINATORS = ("allOf", "anyOf", "oneOf")


def close_objects(schema: Any, names: tuple[str, ...] = (), close: bool = True) -> Any:
    """A copy of `schema` where every object schema that says nothing of `additionalProperties`
    (nor `unevaluatedProperties`) says false.

    A schema and its `allOf`/`anyOf`/`oneOf` members are intersected, so closing each over its own
    properties would forbid the keys the others list. Each is closed over every name the rest of
    the intersection lists instead (`names`, added as `"name": true`, which allows the key and
    leaves its value to the schema that lists it), in one order: llguidance generates listed
    properties in their order, and an intersection takes its member's. Where a member is a `$ref`
    its names are not seen here, so that schema and its members are left open (what it refers to
    is still closed)."""
    if not isinstance(schema, dict):
        return schema  # true / false, or something the compiler will name as wrong
    out = dict(schema)
    for key in ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    members = {key: out[key] for key in COMBINATORS if isinstance(out.get(key), list)}
    if any(isinstance(m, dict) and "$ref" in m for group in members.values() for m in group):
        close = False
    own = (*names, *_properties(out))
    listed = {key: tuple(n for m in group for n in _properties(m)) for key, group in members.items()}
    everything = _ordered(own, *listed.values())
    for key, group in members.items():
        # allOf members meet each other; anyOf/oneOf alternatives meet everything but each other.
        others = everything if key == "allOf" else _ordered(own, *(v for k, v in listed.items() if k != key))
        out[key] = [close_objects(m, others, close) for m in group]
    if isinstance(out.get("prefixItems"), list) and "items" not in out:
        out["items"] = False  # a tuple: only the items it lists (2020-12; `items` as a list is older)
    if close and _is_object(out) and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["properties"] = {name: _properties(out).get(name, True) for name in everything}
        out["additionalProperties"] = False
    _bound_number(out)
    return out


# A number the schema does not bound lets a small model write digits until max_tokens: SmolLM2, asked
# the issue's "Answer in JSON about a small town by the sea." with {"population": {"type": "integer"}},
# wrote "population": 1000000000... for all 160 tokens, and "area_km2": 1200000000000000.0000000000...
# once the integer part was bounded. Where a schema gives no bound, the range is JSON's interoperable
# one (RFC 8259: a double holds every integer up to 2^53 - 1 exactly), and a number without
# `multipleOf` has at most 9 decimals.
MAX_SAFE_INTEGER = 2**53 - 1
FINEST_DECIMAL = 1e-9


def _bound_number(schema: dict) -> None:
    kinds = schema.get("type")
    if not {"integer", "number"} & set(kinds if isinstance(kinds, list) else [kinds]):
        return
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        schema["minimum"] = -MAX_SAFE_INTEGER
    if "maximum" not in schema and "exclusiveMaximum" not in schema:
        schema["maximum"] = MAX_SAFE_INTEGER
    if kinds != "integer" and "multipleOf" not in schema:
        schema["multipleOf"] = FINEST_DECIMAL


def _ordered(*groups: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for group in groups for name in group))


def _properties(schema: Any) -> dict:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema \
        or "required" in schema


# json_object ("any JSON object") for a model that may never close one: llguidance cannot forbid a
# repeated key, so SmolLM2 at temperature 0 wrote `{", ": 1000000000.000000, ": 1000...` and endless
# strings, arrays and nestings until max_tokens (0 of 5 prompts parsed within 80 tokens). Bounded
# instead: keys are names (a letter or _ first, at most 32 characters), at most 5 of them, values are
# strings of at most 32 characters, numbers within +-1e9 with at most 6 decimals, booleans, null, or
# one level of arrays (at most 5 items) and objects (at most 3 keys) of those. A schema of
# {"type": "object", "additionalProperties": true}, or disable_additional_properties false, lifts it.
MAX_KEYS, MAX_NESTED_KEYS, MAX_ITEMS, MAX_STRING = 5, 3, 5, 32
KEY = r"^[\p{L}_][\p{L}\p{N}_ .-]{0,31}$"
SCALARS = [{"type": "string", "maxLength": MAX_STRING},
           {"type": "number", "minimum": -1e9, "maximum": 1e9, "multipleOf": 1e-6},
           {"type": "boolean"}, {"type": "null"}]


def _object_of(value: dict, max_keys: int) -> dict:
    return {"type": "object", "patternProperties": {KEY: value}, "additionalProperties": False,
            "maxProperties": max_keys}


BOUNDED_OBJECT = _object_of({"anyOf": [*SCALARS, {"type": "array", "items": {"anyOf": SCALARS}, "maxItems": MAX_ITEMS},
                                       _object_of({"anyOf": SCALARS}, MAX_NESTED_KEYS)]}, MAX_KEYS)
