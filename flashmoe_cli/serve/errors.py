"""An API error: the HTTP status and the message the client gets, in either API's shape."""
from __future__ import annotations

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "invalid_api_key", 404: "not_found_error",
                             429: "rate_limit_exceeded"}.get(status, "server_error")

    def openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}

    def anthropic(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "api_error"),
                                           "message": self.message}}


def unknown_fields(body: dict, known: set[str], where: str = "") -> None:
    """A field we do not implement is an error that names it, never dropped in silence."""
    extra = sorted(set(body) - known)
    if extra:
        raise APIError(400, f"unsupported field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}"
                            f"{' in ' + where if where else ''}: flashmoe serve does not implement "
                            f"{'them' if len(extra) > 1 else 'it'}", param=extra[0])


def expect(value, kind: type, name: str):
    if not isinstance(value, kind):
        raise APIError(400, f"{name} must be a {kind.__name__}, got {type(value).__name__}", param=name)
    return value
