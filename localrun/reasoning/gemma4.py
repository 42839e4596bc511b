"""Google Gemma 4: the thought in a channel, `<|channel>thought\\n…<channel|>`, then the answer.

With `enable_thinking` on, the template writes `<|think|>` at the top of the system turn and the
model opens the channel itself; off (the template's default), the generation prompt ends with an
empty channel, `<|channel>thought\\n<channel|>`, and the model answers at once. As llama.cpp's
parser does, more `<|channel>` tokens before the first thought are skipped, and a thought channel
(Gemma 4 writes empty ones) or a stray `<channel|>` after the answer is not answer text: it is
dropped, as the template drops it from the history (llama.cpp adds a later thought to the
reasoning; here the thought always comes before the answer).
"""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import (
    HasToken,
    MarkerSplitter,
    ReasoningFormat,
    Split,
    Splitter,
    held,
    no_token,
    register,
)

CHANNEL, THOUGHT, END = "<|channel>", "<|channel>thought", "<channel|>"


@register(25)
class Gemma4(ReasoningFormat):
    """<|channel>thought\\n thought <channel|> answer; switched by enable_thinking (off by default)."""

    name: ClassVar[str] = "gemma4"
    opening: ClassVar[tuple[str, ...]] = (THOUGHT,)
    closing: ClassVar[str] = END
    switched_by: ClassVar[tuple[str, ...]] = ("enable_thinking",)

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return THOUGHT in template and END in template

    def splitter(self, start_inside: bool = False) -> Splitter:
        return Gemma4Splitter(start_inside)


class Gemma4Splitter(MarkerSplitter):
    """A MarkerSplitter that skips repeated channel openers before the thought and drops the
    channel blocks and stray closers that Gemma 4 writes after its answer."""

    def __init__(self, start_inside: bool = False) -> None:
        super().__init__((THOUGHT,), END, start_inside=start_inside)

    def flush(self) -> Split:
        """The end of the reply; a later channel it was cut inside is dropped, as a closed one is."""
        if self._phase == "answer" and self._buf.startswith(CHANNEL):
            self._buf = ""
        return super().flush()

    def _before(self) -> Split | None:
        text = self._buf.lstrip()
        while text.startswith(CHANNEL + CHANNEL):
            text = text[len(CHANNEL):]
        if text.startswith(CHANNEL) and CHANNEL.startswith(text[len(CHANNEL):]):
            return None  # another opener may follow
        self._buf = text
        return super()._before()

    def _answer(self) -> Split | None:
        if not self._buf:
            return None
        found = [(i, m) for m in (CHANNEL, END) if (i := self._buf.find(m)) >= 0]
        if not found:
            keep = held(self._buf, (CHANNEL, END))
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(ready):]
            return Split(answer=ready) if ready else None
        i, marker = min(found)
        ready = self._buf[:i]
        if marker == END:
            self._buf = self._buf[i + len(END):]
        else:
            j = self._buf.find(END, i)
            if j < 0:
                self._buf = self._buf[i:]  # wait for the channel to close
                return Split(answer=ready) if ready else None
            self._buf = self._buf[j + len(END):]
        return Split(answer=ready)
