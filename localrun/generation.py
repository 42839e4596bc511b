"""Values that cross module and process boundaries: requests and streamed chunks (a request's
settings are in settings.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from localrun.chat import Message, parse_messages
from localrun.errors import UsageError

THINK_EFFORTS = ("low", "medium", "high")


def _check(cond: bool, flag: str, value: Any, expected: str) -> None:
    if not cond:
        raise UsageError(f"invalid value for {flag}: {value!r}", f"expected {expected}")


@dataclass(frozen=True)
class Request:
    """What to generate from: chat messages (templated) or a raw prompt."""

    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] = field(default=(), hash=False)  # rendered by the chat template
    # Thinking on (True), off (False), at an effort ("low", "medium", "high"), or as the template's default (None)
    think: bool | str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # a client's chat_template_kwargs
    template: str | None = None  # a Jinja chat template used instead of the model's own (a preset's TEMPLATE)

    @property
    def images(self) -> int:
        """How many images the messages carry."""
        return sum(len(m.images) for m in self.messages)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise UsageError("a request needs either messages or a raw prompt")
        if self.tools and self.prompt is not None:
            raise UsageError("tools need chat messages, not a raw prompt")
        _check(self.think in (None, True, False, *THINK_EFFORTS), "think", self.think,
               f"true, false or an effort ({', '.join(THINK_EFFORTS)})")
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs or {}))

    @classmethod
    def chat(cls, messages: Any, tools: Any = (), think: bool | str | None = None,
             template_kwargs: dict[str, Any] | None = None) -> Request:
        return cls(messages=tuple(parse_messages(messages)), tools=tuple(tools or ()), think=think,
                   template_kwargs=dict(template_kwargs or {}))

    @classmethod
    def raw(cls, prompt: str, system: str | None = None) -> Request:
        """Plain-text completion; a system prompt, if any, goes before it as a paragraph."""
        return cls(prompt=f"{system}\n\n{prompt}" if system else prompt)

    def template_extras(self) -> dict[str, Any]:
        """What the chat template gets beyond the messages: the tools, when there are any."""
        return {"tools": [dict(t) for t in self.tools]} if self.tools else {}

    def to_dict(self) -> dict[str, Any]:
        from localrun.images import to_base64

        messages = [m.to_dict() | ({"images": [to_base64(b) for b in m.images]} if m.images else {})
                    for m in self.messages]
        return {"messages": messages, "prompt": self.prompt, "tools": list(self.tools),
                "think": self.think, "template_kwargs": dict(self.template_kwargs), "template": self.template}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Request:
        if data.get("prompt") is not None:
            return cls(prompt=data["prompt"], think=data.get("think"))
        req = cls.chat(data["messages"], data.get("tools") or (), data.get("think"), data.get("template_kwargs"))
        return replace(req, template=data["template"]) if data.get("template") else req


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, with the most likely alternatives at its position."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple[TokenLogprob, ...] = ()

    def to_list(self) -> list[Any]:
        """A compact JSON form: [token, logprob, bytes, [[token, logprob, bytes], ...]]."""
        return [self.token, self.logprob, list(self.bytes), [[t.token, t.logprob, list(t.bytes)] for t in self.top]]

    @classmethod
    def from_list(cls, data: list[Any]) -> TokenLogprob:
        return cls(data[0], data[1], tuple(data[2]), tuple(cls(t[0], t[1], tuple(t[2])) for t in data[3]))


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed output; the last one has done=True and the statistics."""

    text: str = ""
    done: bool = False
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    seed: int | None = None
    cached_tokens: int = 0  # prompt tokens found in the KV cache (not evaluated again)
    thinking: str = ""  # a thinking model's thought, kept apart from the answer (text)
    thinking_tokens: int = 0  # on the last chunk: tokens generated inside the thought
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text is in this chunk
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    drafted_tokens: int = 0  # on the last chunk: tokens speculative decoding drafted for the reply
    accepted_tokens: int = 0  # of those, the ones the model kept
    images_encoded: int = 0  # on the last chunk: images the prompt's evaluation encoded (cached ones are not)
    stop_sequence: str | None = None  # on the last chunk: the request's stop sequence that ended the reply

    @classmethod
    def final(cls, finish_reason: str, prompt_tokens: int, completion_tokens: int, t_start: float,
              t_prompt_done: float, t_end: float, seed: int | None, cached_tokens: int = 0) -> Chunk:
        """The last chunk of a reply, from perf_counter() stamps at its start, after the prompt, at its end."""
        return cls(done=True, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                   completion_tokens=completion_tokens, prompt_ms=(t_prompt_done - t_start) * 1000,
                   decode_ms=(t_end - t_prompt_done) * 1000, seed=seed, cached_tokens=cached_tokens)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: generated tokens over the time spent generating them."""
        return self.completion_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["logprobs"] = [lp.to_list() for lp in self.logprobs]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Chunk:
        lps = tuple(TokenLogprob.from_list(x) for x in data.get("logprobs") or ())
        return cls(**{**data, "logprobs": lps})
