"""Tool calls in a model's own text format: prompting, forcing and parsing them. No jax.

A format (chosen by `--tool-call-parser`, vLLM's flag) knows three things:

1. how tools, earlier calls and tool results are written into the prompt when the model's chat
   template does not render them itself (SmolLM2's does not: it gets the Hermes/Qwen2.5 system
   prompt below, calls as `<tool_call>` blocks, results as `<tool_response>` user turns);
2. the grammar that forces a call (`tool_choice` "required" or a named function): the format's
   call syntax around each tool's parameter schema, so the arguments always validate;
3. how to find calls in generated text (`tool_choice` "auto"), incrementally, so a stream and a
   whole response split text and calls alike.

Hermes format (NousResearch Hermes 2 Pro, Qwen2.5):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
import uuid

from orca_jax.engine.json_schema import close_objects
from orca_jax.engine.structured_output import JSON_OPTIONS

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NEWLINE = "\n"

HERMES_SYSTEM = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_renders_tools(template: str) -> bool:
    """Whether a chat template handles `tools` itself (HF templates that do name the variable)."""
    return "tools" in template


def _arguments(text: str):
    """A call's arguments as the template sees them: the parsed object (as vLLM passes them), or the
    text when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def messages_for_template(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """The conversation as the chat template gets it. A template that renders tools itself (`native`)
    gets OpenAI's messages with call arguments parsed; any other gets plain role/content messages
    in the Hermes format."""
    if native:
        out = []
        for message in messages:
            message = dict(message)
            if "tool_calls" in message:
                message["tool_calls"] = [{**call, "function": {**call["function"],
                                                                "arguments": _arguments(call["function"]["arguments"])}}
                                         for call in message["tool_calls"]]
            out.append(message)
        return out
    out = []
    if tools:
        listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            messages = messages[1:]
        out.append({"role": "system", "content": system})
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "assistant" and message.get("tool_calls"):
            blocks = [render_call(call["function"]["name"], _arguments(call["function"]["arguments"]))
                      for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_responses"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + response
                continue
            out.append({"role": "user", "content": response, "tool_responses": True})
            continue
        out.append({"role": role, "content": content})
    for message in out:
        message.pop("tool_responses", None)
    return out


def render_call(name: str, arguments) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


# OpenAI: a function without `parameters` takes none.
NO_PARAMETERS = {"type": "object", "properties": {}}


def forced_grammar(tools: list[dict], tool_choice: str | dict, parallel: bool,
                   disable_additional_properties: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) for `required` (one call of any tool, or several when
    `parallel`) or a named function (exactly one call of it). `disable_additional_properties`: the
    arguments get only the properties their schema lists (engine/json_schema.py), as json_schema
    outputs do; else SmolLM2 fills `{"properties": {}}` with invented ones until max_tokens."""
    if isinstance(tool_choice, dict):
        tools = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
        parallel = False

    def call_schema(tool: dict) -> dict:
        function = tool["function"]
        parameters = function.get("parameters") or NO_PARAMETERS
        if disable_additional_properties:
            parameters = close_objects(parameters)
        return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    schema = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    schema["x-guidance"] = JSON_OPTIONS
    more = ' ("\\n" call)*' if parallel else ""
    call = f"{json.dumps(OPEN + NEWLINE)} %json {json.dumps(schema)} {json.dumps(NEWLINE + CLOSE)}"
    return f"start: call{more}\ncall: {call}\n"


class HermesParser:
    """Splits generated text into content and `<tool_call>` JSON blocks, as it arrives.

    Whitespace around a call is not content. Text that could still become `<tool_call>` is held
    back until the next piece decides it. A block that is not a JSON {"name", "arguments"} object
    stays content, as the model wrote it, unless the call was `forced` (tool_choice "required" or
    named): its grammar wrote the block, so one that max_tokens cut is still a call, with the
    arguments as far as they got (as OpenAI returns a cut call, with finish_reason "length")."""

    def __init__(self, forced: bool = False):
        self._forced = forced
        self._buffer = ""  # text not yet classified
        self._held = ""  # trailing whitespace of the content so far: dropped if a call follows
        self._in_call = False
        self._after_call = False  # skip the whitespace that follows a call
        self.calls: list[dict] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """(new content, newly completed calls). `final`: the text is complete; flush everything."""
        self._buffer += text
        content, calls = "", []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0 and not final:
                    break
                body = self._buffer if end < 0 else self._buffer[:end]  # an unclosed call at the end
                self._buffer = "" if end < 0 else self._buffer[end + len(CLOSE):]
                self._in_call = False
                call = _parse_call(body)
                if call is None and self._forced and end < 0:
                    call = _cut_call(body)
                if call is None:
                    content += self._content(OPEN + body + ("" if end < 0 else CLOSE))
                else:
                    calls.append(call)
                    self._held, self._after_call = "", True
                continue
            if self._after_call:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._after_call = False
            start = self._buffer.find(OPEN)
            if start >= 0:
                content += self._content(self._buffer[:start])
                self._held, self._buffer, self._in_call = "", self._buffer[start + len(OPEN):], True
                continue
            keep = 0 if final else _partial_suffix(self._buffer, OPEN)
            content += self._content(self._buffer[:len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        if final and not self.calls and not calls:
            content, self._held = content + self._held, ""
        self.calls += calls
        return content, calls

    def _content(self, text: str) -> str:
        """Content up to its last non-space character; the trailing whitespace waits."""
        text = self._held + text
        visible = text.rstrip()
        self._held = text[len(visible):]
        return visible


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _parse_call(body: str) -> dict | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": new_call_id(), "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


# What a forced call's grammar writes before the arguments (json.dumps' layout, JSON_OPTIONS).
CUT_CALL = re.compile(r'\s*\{"name": "((?:[^"\\]|\\.)*)("(, "arguments": )?)?(.*)', re.DOTALL)


def _cut_call(body: str) -> dict:
    """A forced call that max_tokens cut: its name (as far as written) and its arguments' text."""
    match = CUT_CALL.match(body)
    name, arguments = (match.group(1), match.group(4) if match.group(3) else "") if match else ("", "")
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CALL_PARSERS = {"hermes": HermesParser}


def parse_text(text: str, parser: str, forced: bool = False) -> tuple[str | None, list[dict]]:
    """Content (None when empty) and calls of a whole generated text."""
    content, calls = TOOL_CALL_PARSERS[parser](forced).feed(text, final=True)
    return content or None, calls
