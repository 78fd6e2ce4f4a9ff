"""Schemas closed before compiling (engine/json_schema.py), checked through llguidance on SmolLM2's
tokenizer: what each rewritten schema lets through, and what it no longer does."""

import json

import pytest

from orca_jax.engine.json_schema import BOUNDED_OBJECT, close_objects
from orca_jax.engine.structured_output import GrammarCompiler
from orca_jax.sampling_params import StructuredOutputsParams

A = {"type": "object", "properties": {"a": {"type": "integer"}}}
B = {"type": "object", "properties": {"b": {"type": "integer"}}}


@pytest.fixture(scope="module")
def accepts(smollm2):
    compiler = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)

    def check(text: str, strict: bool | None = None, **constraint) -> bool:
        """Whether the grammar takes `text` whole and is complete after it."""
        grammar = compiler.grammar(StructuredOutputsParams(**constraint, disable_additional_properties=strict))
        for token in smollm2.tokenizer.encode(text):
            grammar.accept(token)
            if grammar.error:
                return False
        return grammar.finished or grammar._matcher.is_accepting()

    return check


@pytest.mark.parametrize("schema, good, bad", [
    (A, '{"a": 1}', '{"a": 1, "c": 2}'),
    ({"type": "object", "properties": {}}, "{}", '{"type": "object"}'),
    ({"type": "object", "properties": {"x": A}}, '{"x": {"a": 1}}', '{"x": {"a": 1, "c": 2}}'),
    ({"type": "array", "items": A}, '[{"a": 1}]', '[{"a": 1, "c": 2}]'),
    ({"$defs": {"A": A}, "type": "object", "properties": {"x": {"$ref": "#/$defs/A"}}}, '{"x": {"a": 1}}',
     '{"x": {"a": 1, "c": 2}}'),
    # Members of an intersection allow each other's keys, and only those.
    ({"allOf": [A, B]}, '{"a": 1, "b": 2}', '{"a": 1, "c": 2}'),
    ({"type": "object", "properties": {"k": {"type": "integer"}}, "anyOf": [A, B]}, '{"k": 1, "b": 2}',
     '{"k": 1, "a": 1, "b": 2}'),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", "[1, 2]"),
])
def test_only_listed_properties_and_items(accepts, schema, good, bad):
    assert accepts(good, json=schema) and accepts(bad, json=schema, strict=False)
    assert not accepts(bad, json=schema)


def test_schemas_that_allow_more_stay_open(accepts):
    for extra in (True, {"type": "integer"}):
        assert accepts('{"a": 1, "c": 2}', json={**A, "additionalProperties": extra})
    # (the integer property also gets its range: test_numbers_without_bounds_get_the_interoperable_range)
    assert close_objects({**A, "additionalProperties": True})["additionalProperties"] is True
    closed = close_objects(json.loads(json.dumps(A)))
    assert closed["additionalProperties"] is False and list(closed["properties"]) == ["a"]


def test_json_object_is_bounded(accepts):
    assert accepts('{"name": "Sailor\'s Cove", "beaches": [1, 2.5], "mayor": {"name": null}}', json_object=True)
    too_many = "{" + ", ".join(f'"k{i}": {i}' for i in range(6)) + "}"
    for bad in (too_many, '{"s": "' + "x" * 33 + '"}', '{", ": 1}', '{"a": [' + ", ".join("1" * 6) + "]}",
                '{"a": {"b": {"c": 1}}}', '{"a": 0.1234567}'):
        assert not accepts(bad, json_object=True), bad
        assert accepts(bad, json_object=True, strict=False), bad
    assert BOUNDED_OBJECT["maxProperties"] == 5


def test_no_whitespace_runs(accepts):
    """Only json.dumps' separators: a small model cannot pad with newlines instead of closing."""
    assert accepts('{"a": 1}', json=A)
    for bad in ('{\n"a": 1}', '{"a":  1}', '{"a": 1 }'):
        assert not accepts(bad, json=A) and not accepts(bad, json_object=True)


def test_the_engine_setting_is_the_default(smollm2):
    """--structured-outputs-config's disable_additional_properties reaches requests that leave it out."""
    lenient = GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size, disable_additional_properties=False)
    grammar = lenient.grammar(StructuredOutputsParams(json=A))
    for token in smollm2.tokenizer.encode('{"a": 1, "c": 2}'):
        grammar.accept(token)
    assert not grammar.error


def test_numbers_without_bounds_get_the_interoperable_range(accepts):
    closed = close_objects({"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                                             "k": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "q": {"type": "number", "multipleOf": 0.5}}})
    n, x, k, q = (closed["properties"][name] for name in "nxkq")
    assert (n["minimum"], n["maximum"]) == (-(2**53 - 1), 2**53 - 1) and "multipleOf" not in n
    assert x["maximum"] == 2**53 - 1 and x["multipleOf"] == 1e-9
    assert (k["minimum"], k["maximum"]) == (0, 9) and q["multipleOf"] == 0.5  # a schema's own bounds stay
    schema = {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"}}, "required": ["x", "n"]}
    assert accepts('{"x": 3.14159, "n": -42}', json=schema)
    assert not accepts('{"x": 0.0000000001, "n": 1}', json=schema)  # 10 decimals
    assert not accepts('{"x": 2, "n": 9007199254740992}', json=schema)  # 2^53
    assert accepts('{"x": 0.0000000001, "n": 9007199254740992}', json=schema, strict=False)
