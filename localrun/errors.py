"""Errors a user can cause: each names the thing and the next step."""

from __future__ import annotations


class LocalrunError(Exception):
    """Base of every error localrun reports to a user.

    Args:
        message: what went wrong, naming the thing (model, file, flag).
        hint: the next step the user can take, if there is one.
    """

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class UsageError(LocalrunError):
    """An invalid flag value or argument; `param`: the request field it names, where there is one."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None, param: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class ModelNotFoundError(LocalrunError):
    """A model name that is not installed and is not a path."""


class NotFoundError(LocalrunError):
    """Something else a request names that does not exist (a stored response)."""


class BadModelFileError(LocalrunError):
    """A model file that is missing, truncated or malformed."""


class StoreError(LocalrunError):
    """The local model store cannot be read or written."""


class EngineError(LocalrunError):
    """The inference engine failed (bad request, out of memory, ...)."""


class EngineCrashedError(EngineError):
    """The engine process died; localrun itself keeps running."""


class ContextOverflowError(EngineError):
    """A prompt that does not fit in the context window."""


class ServerBusyError(EngineError):
    """Every sequence of a model is busy and its queue is full."""


class BackendUnavailableError(LocalrunError):
    """An engine that is not installed or cannot run this model."""


class ConversionError(LocalrunError):
    """A checkpoint that cannot be converted."""


class HubError(LocalrunError):
    """A Hub request or download that failed."""


class CancelledError(LocalrunError):
    """An operation the user stopped."""

    exit_code = 130
