"""The Hermes tool-call format without a server: prompting, forcing (grammar) and parsing."""

import json

import pytest

from orca_jax.engine.structured_output import GrammarCompiler
from orca_jax.sampling_params import StructuredOutputsParams
from orca_jax.server.tool_calls import HermesParser, forced_grammar, messages_for_template, parse_text, render_call

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TEXT = ("Let me check. \n" + render_call("get_weather", {"city": "Paris"}) + "\n" + render_call("add", {"a": 1, "b": 2})
        + "\n")


def names_and_arguments(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_whole_text():
    content, calls = parse_text(TEXT, "hermes")
    assert content == "Let me check."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_text("no calls here ", "hermes") == ("no calls here ", [])
    # A block that is not a call stays content; an unclosed call at the very end still counts.
    assert parse_text("<tool_call>{oops}</tool_call>", "hermes") == ("<tool_call>{oops}</tool_call>", [])
    _, calls = parse_text('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "hermes")
    assert names_and_arguments(calls) == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_pieces_split_as_the_whole_text(piece):
    parser, content, calls = HermesParser(), "", []
    text = "Hi <tool_c" + TEXT
    for start in range(0, len(text), piece):
        new_content, new_calls = parser.feed(text[start:start + piece])
        content, calls = content + new_content, calls + new_calls
    new_content, new_calls = parser.feed("", final=True)
    whole_content, whole_calls = parse_text(text, "hermes")
    assert content + new_content == whole_content
    assert names_and_arguments(calls + new_calls) == names_and_arguments(whole_calls)


def test_text_that_may_start_a_call_is_held_back():
    parser = HermesParser()
    assert parser.feed("Sure <tool") == ("Sure", [])  # the space waits too: it is dropped if a call follows
    assert parser.feed("box>") == (" <toolbox>", [])


@pytest.fixture(scope="module")
def compiler(smollm2):
    return smollm2.tokenizer, GrammarCompiler(smollm2.tokenizer, smollm2.config.vocab_size)


def accepts(compiler, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token accepted, the grammar finished) for `text` under `grammar`."""
    tokenizer, grammars = compiler
    state = grammars.grammar(StructuredOutputsParams(grammar=grammar))
    for token in tokenizer.encode(text):
        state.accept(token)
        if state.error:
            return False, False
    return True, state.finished


def test_forced_grammars(compiler):
    named = forced_grammar([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, parallel=True)
    assert accepts(compiler, named, render_call("add", {"a": 1, "b": -2})) == (True, True)  # one call, then done
    assert not accepts(compiler, named, render_call("get_weather", {"city": "Paris"}))[0]
    assert not accepts(compiler, named, render_call("add", {"a": "one", "b": 2}))[0]  # arguments follow the schema
    required = forced_grammar([WEATHER, ADD], "required", parallel=True)
    two = render_call("get_weather", {"city": "Paris"}) + "\n" + render_call("add", {"a": 1, "b": 2})
    assert accepts(compiler, required, two) == (True, False)  # more calls may follow
    assert not accepts(compiler, required, "Hello")[0]  # a call is required
    single = forced_grammar([WEATHER, ADD], "required", parallel=False)
    assert accepts(compiler, single, render_call("add", {"a": 1, "b": 2})) == (True, True)


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
                    {"city": city})}} for i, city in ((1, "Paris"), (2, "Rome"))]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


def test_hermes_prompt_for_templates_without_tools():
    rendered = messages_for_template(MESSAGES, [WEATHER], native=False)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in rendered[0]["content"]
    assert rendered[2]["content"] == (render_call("get_weather", {"city": "Paris"}) + "\n"
                                      + render_call("get_weather", {"city": "Rome"}))
    assert rendered[3]["content"] == ("<tool_response>\nsunny\n</tool_response>\n"
                                      "<tool_response>\nrain\n</tool_response>")
    # Without tools in the request (a plain chat), messages pass unchanged.
    assert messages_for_template(MESSAGES[:2], None, native=False) == MESSAGES[:2]


def test_templates_that_render_tools_get_them(compiler):
    tokenizer, _ = compiler
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ greeting }}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% endfor %}")
    messages = messages_for_template(MESSAGES[1:4], [WEATHER], native=True)
    text = tokenizer.apply_chat_template(messages, tools=[WEATHER], template=template, greeting="hello")
    assert text == ("[get_weather]hello<user>Weather in Paris and Rome?"
                    "<assistant>get_weather(Paris)get_weather(Rome)<tool>sunny")


def test_forced_call_of_a_tool_without_parameters_is_empty(compiler):
    """`"properties": {}` (or no parameters) admits only `{}`: SmolLM2 filled it with invented keys."""
    for parameters in ({"type": "object", "properties": {}}, None):
        tool = {"type": "function", "function": {"name": "get_time", **({"parameters": parameters} if parameters else {})}}
        grammar = forced_grammar([tool], "required", parallel=False)
        assert accepts(compiler, grammar, render_call("get_time", {})) == (True, True)
        assert not accepts(compiler, grammar, render_call("get_time", {"type": "object"}))[0]
    lenient = forced_grammar([WEATHER], "required", parallel=False, disable_additional_properties=False)
    assert accepts(compiler, lenient, render_call("get_weather", {"city": "Paris", "when": "now"})) == (True, True)
    strict = forced_grammar([WEATHER], "required", parallel=False)
    assert not accepts(compiler, strict, render_call("get_weather", {"city": "Paris", "when": "now"}))[0]


def test_a_forced_call_cut_short_is_still_a_call():
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b'
    assert parse_text(cut, "hermes") == (cut, [])  # "auto": the model's own text, whatever it is
    content, calls = parse_text(cut, "hermes", forced=True)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("add", '{"a": 1, "b')]
    _, calls = parse_text('<tool_call>\n{"name": "ad', "hermes", forced=True)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("ad", "")]
