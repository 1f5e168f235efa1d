"""An API error: the HTTP status and the message the client gets, in either API's shape."""

from __future__ import annotations

import re

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    421: "permission_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    421: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
}

# An absolute path in a message (a model folder, a home directory): never sent to a client.
_ABS_PATH = re.compile(r"(?<![\w.:/~-])(?:/[\w.@+-]+)+/([\w.@+-]+)")


def scrub_paths(message: str) -> str:
    """`message` with every absolute path cut to its last part."""
    return _ABS_PATH.sub(r"\1", message)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None):
        # (a client's text quoted in it may hold a lone surrogate, which no JSON response can carry)
        message = scrub_paths(message).encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or OPENAI_TYPES.get(status, "server_error")

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}

    def anthropic(self) -> dict:
        return {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"), "message": self.message},
        }


def expect(value, kind: type, name: str):
    if not isinstance(value, kind):
        raise APIError(400, f"{name} must be a {kind.__name__}, got {type(value).__name__}", param=name)
    return value
