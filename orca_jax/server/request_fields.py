"""OpenAI's error answer (`APIError`) and reading one field of a JSON request body, typed, with a
400 that names the field. No jax, no aiohttp.
"""

from __future__ import annotations

from typing import Any


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


TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "an object", type(None): "null"}


def get_field(body: dict, field: str, kind: type, default: Any = None) -> Any:
    """The field's value checked against `kind` (null means absent). JSON has no int/float split,
    so a float field takes integers; booleans are never numbers."""
    value = body.get(field)
    if value is None:
        return default
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (kind is not bool and isinstance(value, bool)):
        raise invalid(f"'{field}' must be {TYPE_NAMES[kind]}, got {json_type(value)}", field)
    return value


def json_type(value: Any) -> str:
    return TYPE_NAMES.get(type(value), type(value).__name__)


def read_max_tokens(body: dict) -> int | None:
    # max_completion_tokens is OpenAI's newer name; a client may send both, the new one wins.
    value = get_field(body, "max_completion_tokens", int)
    return value if value is not None else get_field(body, "max_tokens", int)
