"""The converter's own error: names the thing that failed and the next step."""

from __future__ import annotations


class ConvertError(Exception):
    """A checkpoint, tokenizer, flag or output file that cannot be converted.

    The CLI wraps it into `localrun.errors.ConversionError`; `convert` never imports localrun.
    """

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message
