"""How localrun's errors look on the wire: one table per API family."""

from __future__ import annotations

from typing import Any

from localrun.errors import (
    BackendUnavailableError,
    BadModelFileError,
    CancelledError,
    ContextOverflowError,
    EngineCrashedError,
    EngineError,
    HubError,
    LocalrunError,
    ModelNotFoundError,
    NotFoundError,
    ServerBusyError,
    UsageError,
)

# error class -> (HTTP status, OpenAI "type", OpenAI "code"); looked up along the class's MRO.
OPENAI: dict[type[LocalrunError], tuple[int, str, str | None]] = {
    ModelNotFoundError: (404, "invalid_request_error", "model_not_found"),
    NotFoundError: (404, "invalid_request_error", "not_found"),
    ContextOverflowError: (400, "invalid_request_error", "context_length_exceeded"),
    UsageError: (400, "invalid_request_error", None),
    ServerBusyError: (503, "server_error", "server_busy"),
    EngineCrashedError: (500, "server_error", "engine_crashed"),
    EngineError: (500, "server_error", None),
    BackendUnavailableError: (400, "invalid_request_error", "model_not_supported"),
    BadModelFileError: (500, "server_error", "bad_model_file"),
    HubError: (502, "server_error", None),
    CancelledError: (499, "invalid_request_error", "cancelled"),
    LocalrunError: (500, "server_error", None),
}

# error class -> HTTP status for Ollama's {"error": "..."}.
OLLAMA: dict[type[LocalrunError], int] = {
    ModelNotFoundError: 404,
    NotFoundError: 404,
    ContextOverflowError: 400,
    UsageError: 400,
    ServerBusyError: 503,
    EngineError: 500,
    BackendUnavailableError: 400,
    BadModelFileError: 500,
    HubError: 502,
    CancelledError: 499,
    LocalrunError: 500,
}

# error class -> (HTTP status, Anthropic error "type"); 529 is Anthropic's "overloaded".
ANTHROPIC: dict[type[LocalrunError], tuple[int, str]] = {
    ModelNotFoundError: (404, "not_found_error"),
    NotFoundError: (404, "not_found_error"),
    ContextOverflowError: (400, "invalid_request_error"),
    UsageError: (400, "invalid_request_error"),
    ServerBusyError: (529, "overloaded_error"),
    EngineError: (500, "api_error"),
    BackendUnavailableError: (400, "invalid_request_error"),
    BadModelFileError: (500, "api_error"),
    HubError: (502, "api_error"),
    CancelledError: (499, "invalid_request_error"),
    LocalrunError: (500, "api_error"),
}
_ANTHROPIC_HTTP = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 415: "invalid_request_error"}

# Plain HTTP failures outside any endpoint (auth, body size, unknown route).
_HTTP_TYPES = {401: ("authentication_error", "invalid_api_key"), 403: ("permission_error", None),
               404: ("invalid_request_error", "not_found"), 405: ("invalid_request_error", None),
               413: ("invalid_request_error", "request_too_large")}


def _lookup(table: dict[type[LocalrunError], Any], error: LocalrunError) -> Any:
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    return table[LocalrunError]


def message(error: LocalrunError) -> str:
    """The error's text with its hint, as the CLI would print it."""
    return str(error)


def openai_status(error: LocalrunError) -> int:
    return int(_lookup(OPENAI, error)[0])


def openai_body(error: LocalrunError, param: str | None = None) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}} for a localrun error."""
    _, kind, code = _lookup(OPENAI, error)
    return {"error": {"message": message(error), "type": kind, "param": param, "code": code}}


def openai_http(status: int, text: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's shape for a failure that is not a localrun error (bad JSON, auth, size)."""
    kind, default_code = _HTTP_TYPES.get(status, ("invalid_request_error" if status < 500 else "server_error", None))
    return {"error": {"message": text, "type": kind, "param": param, "code": code or default_code}}


def ollama_status(error: LocalrunError) -> int:
    return int(_lookup(OLLAMA, error))


def ollama_body(error: LocalrunError) -> dict[str, Any]:
    return {"error": message(error)}


def anthropic_status(error: LocalrunError) -> int:
    return int(_lookup(ANTHROPIC, error)[0])


def anthropic_body(error: LocalrunError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; a prompt past the context in Anthropic's words."""
    text = message(error)
    if isinstance(error, ContextOverflowError):
        import re

        m = re.search(r"the prompt is (\d+) tokens but the context holds (\d+)", text)
        text = f"prompt is too long: {m.group(1)} tokens > {m.group(2)} maximum" if m else text
    return {"type": "error", "error": {"type": _lookup(ANTHROPIC, error)[1], "message": text}}


def anthropic_http(status: int, text: str) -> dict[str, Any]:
    kind = _ANTHROPIC_HTTP.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": text}}


def is_anthropic_path(path: str) -> bool:
    """Whether a request path belongs to Anthropic's Messages API (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def is_openai_path(path: str) -> bool:
    """Whether a request path belongs to the OpenAI family (its errors take OpenAI's shape)."""
    return path == "/v1" or path.startswith("/v1/")


def http_body(path: str, status: int, text: str) -> dict[str, Any]:
    """The error body of the path's API family for a plain HTTP failure on it."""
    if is_anthropic_path(path):
        return anthropic_http(status, text)
    return openai_http(status, text) if is_openai_path(path) else {"error": text}
