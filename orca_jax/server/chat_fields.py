"""A chat request's own fields: messages (content flattened to text, tool calls and tool answers
kept), tools, tool_choice and the chat template's extra variables. No jax, no aiohttp.
"""

from __future__ import annotations

from typing import Any

from orca_jax.server.request_fields import get_field, invalid, json_type

TEMPLATE_VARIABLES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}  # set by the server
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def read_template_kwargs(body: dict) -> dict:
    kwargs = get_field(body, "chat_template_kwargs", dict, {})
    reserved = sorted(set(kwargs) & TEMPLATE_VARIABLES)
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {reserved}: the server sets them from the request",
                      "chat_template_kwargs")
    return kwargs


def read_tools(body: dict) -> list[dict] | None:
    tools = get_field(body, "tools", list)
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


def read_tool_choice(body: dict, tools: list[dict] | None) -> str | dict:
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


def read_messages(body: dict) -> list[dict]:
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
        flat = {"role": "system" if role == "developer" else role,
                "content": read_content_text(message.get("content"), i)}
        if role == "assistant" and message.get("tool_calls"):
            flat["tool_calls"] = read_message_tool_calls(message["tool_calls"], i)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise invalid(f"messages[{i}] (role 'tool') needs 'tool_call_id', the id of the call it answers",
                              "messages")
            flat["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            flat["name"] = message["name"]
        flattened.append(flat)
    return flattened


def read_message_tool_calls(calls: Any, i: int) -> list[dict]:
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


def read_content_text(content: Any, i: int) -> str:
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
