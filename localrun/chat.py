"""Chat templates (sandboxed Jinja), messages, and stop-sequence handling."""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import lru_cache
from typing import Any

from localrun.errors import BadModelFileError, UsageError

ROLES = ("system", "user", "assistant", "tool")
# Used when a model carries no chat template: plain turns the model can continue.
PLAIN_STOPS = ("\nUser:", "\nSystem:")


@dataclass(frozen=True)
class Message:
    """One turn of a conversation.

    An assistant turn may carry tool calls ({"id", "type": "function", "function": {"name",
    "arguments": dict}}), and a tool turn the id and name of the call it answers: the shape chat
    templates read, as transformers passes it. An assistant turn may keep its thought apart from
    its answer (`thinking`); a template gets it under the field its reasoning format names.
    """

    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = field(default=(), hash=False)
    tool_call_id: str | None = None
    name: str | None = None
    thinking: str = ""
    images: tuple[bytes, ...] = field(default=(), hash=False, repr=False)  # image files' bytes, shown before the text

    def to_dict(self, thinking_as: str | None = "thinking") -> dict[str, Any]:
        """The message as a dict; its thought under `thinking_as` (None: left out)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        if self.thinking and thinking_as:
            out[thinking_as] = self.thinking
        return out


def _tool_call(i: int, j: int, raw: Any) -> dict[str, Any]:
    """One call of an assistant turn in the template shape; OpenAI's string arguments are parsed."""
    if not isinstance(raw, Mapping):
        raise UsageError(f"message {i}: tool_calls[{j}] must be an object")
    fn = raw.get("function", raw)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise UsageError(f"message {i}: tool_calls[{j}] needs a function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise UsageError(f"message {i}: tool_calls[{j}] arguments are not JSON ({e})") from e
    call: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if raw.get("id") is not None:
        call["id"] = str(raw["id"])
    return call


def parse_messages(raw: Any) -> list[Message]:
    """Validate a JSON-style list of {role, content} into Messages."""
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)) or not raw:
        raise UsageError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if isinstance(m, Message):
            out.append(m)
            continue
        if not isinstance(m, Mapping):
            raise UsageError(f"message {i} must be an object with a string 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise UsageError(f"message {i} has role {role!r}", f"use one of {', '.join(ROLES)}")
        raw_calls = m.get("tool_calls") or ()
        content = m.get("content")
        if content is None and (raw_calls or role == "assistant"):
            content = ""
        if not isinstance(content, str):
            raise UsageError(f"message {i} must be an object with a string 'content'")
        if not isinstance(raw_calls, Sequence) or isinstance(raw_calls, (str, bytes)):
            raise UsageError(f"message {i}: tool_calls must be a list")
        calls = tuple(_tool_call(i, j, c) for j, c in enumerate(raw_calls))
        call_id, name = m.get("tool_call_id"), m.get("name") or m.get("tool_name")
        out.append(Message(str(role), content, calls, None if call_id is None else str(call_id),
                           None if name is None else str(name), _thinking(i, m), _images(i, m.get("images"))))
    return out


def _images(i: int, raw: Any) -> tuple[bytes, ...]:
    """A message's images: bytes, or base64 text / data URIs (Ollama's `images`), each checked."""
    from localrun import images

    if raw is None:
        return ()
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise UsageError(f"message {i}: images must be a list of base64-encoded images")
    out = []
    for j, item in enumerate(raw):
        what = f"message {i}: image {j + 1}"
        if isinstance(item, (bytes, bytearray)):
            data = bytes(item)
        elif isinstance(item, str):
            data = images.from_base64(item, what)
        else:
            raise UsageError(f"{what} must be base64 text")
        images.facts(data, what)
        out.append(data)
    return tuple(out)


def _thinking(i: int, m: Mapping[str, Any]) -> str:
    """An assistant turn's thought: Ollama's `thinking` or OpenAI's (llama-server's, vLLM's)
    `reasoning_content`; other roles have none."""
    value = m.get("thinking")
    if value is None:
        value = m.get("reasoning_content")
    if value is None or m.get("role") != "assistant":
        return ""
    if not isinstance(value, str):
        raise UsageError(f"message {i}: thinking must be a string")
    return value


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # A plain str, as transformers returns: a Markup would HTML-escape the text it is added to
    # ('"key": ' + val|tojson in Mistral's template).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Limits of one render: a template from a model file must not hang the engine or fill its memory.
TEMPLATE_SECONDS = 5.0  # of work inside the template's own code
TEMPLATE_MIN_OUTPUT = 4 << 20  # characters; a prompt may be larger when its messages are
TEMPLATE_OUTPUT_FACTOR = 8  # ... up to this many times the characters of the messages and tools


LIST_CHANGES = frozenset({"append", "pop"})  # what real templates do to lists they made


class _TemplateLimit(Exception):
    """A render went past a limit (time or size)."""


def _limited_env() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

    class Limited(ImmutableSandboxedEnvironment):  # type: ignore[misc]
        """The immutable sandbox, refusing the operators that build huge values in one step, with
        one opening: a list may be appended to and popped from (Kimi K2's templates queue tool call
        ids that way). Every render gets its own copy of the messages and tools, so what a template
        changes is its own."""

        intercepted_binops = frozenset({"*", "**"})

        def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
            if isinstance(obj, list) and attr in LIST_CHANGES:
                return bool(SandboxedEnvironment.is_safe_attribute(self, obj, attr, value))
            return bool(super().is_safe_attribute(obj, attr, value))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            limit = _LIMITS.output
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, str | list | tuple) and isinstance(n, int) and len(seq) * n > limit:
                        raise _TemplateLimit(f"it builds a value of {len(seq) * n} items (the limit is {limit})")
            elif isinstance(left, int) and isinstance(right, int) and right > 0 \
                    and max(abs(left), 2).bit_length() * right > 1 << 16:
                raise _TemplateLimit(f"it computes {left} ** {right}")
            return super().call_binop(context, operator, left, right)

    return Limited


class _Limits(threading.local):
    """The current render's budget, per thread (the server renders on several at once)."""

    output = TEMPLATE_MIN_OUTPUT


_LIMITS = _Limits()


TEMPLATE_MEMORY = 512 << 20  # bytes a render may add to the process


def _resident() -> int | None:
    """This process's resident memory in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _deadline_tracer(deadline: float) -> Any:
    """A trace function that stops the template's code once the deadline passes or its memory
    grows too much (Jinja compiles a template to Python code, so a loop that produces nothing,
    or a string doubled in a loop, is still seen)."""
    import time

    start = _resident()
    checked = [time.monotonic()]

    def local(frame: Any, event: str, arg: Any) -> Any:
        now = time.monotonic()
        if now > deadline:
            raise _TemplateLimit(f"it ran for more than {TEMPLATE_SECONDS:g} s")
        if start is not None and now - checked[0] >= 0.005:  # memory every few ms of template work
            checked[0] = now
            used = _resident()
            if used is not None and used - start > TEMPLATE_MEMORY:
                raise _TemplateLimit(f"it took more than {TEMPLATE_MEMORY >> 20} MB of memory")
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    return calls


def _generation_block() -> Any:
    """`{% generation %}…{% endgeneration %}`, which templates written for transformers use to
    mark the assistant's tokens for training masks: rendered as its body, as transformers does."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):  # type: ignore[misc]
        tags = {"generation"}  # noqa: RUF012 (jinja2 reads it as a class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    from jinja2.ext import loopcontrols

    env = _limited_env()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_block()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_template(
    source: str,
    messages: Sequence[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    history_field: str | None = None,
    **extra: Any,
) -> str:
    """Render a chat template in jinja2's immutable sandbox. Assistant turns' thoughts go in
    `history_field` (the reasoning format's, e.g. reasoning_content), or are dropped (None).

    Raises BadModelFileError when the template is broken or tries to reach Python internals.
    """
    import sys
    import time

    from jinja2.exceptions import SecurityError, TemplateError

    data = copy.deepcopy([m.to_dict(history_field) for m in messages])
    extra = copy.deepcopy(extra)
    size = sum(len(m.content) + len(m.thinking) for m in messages) + (len(json.dumps(extra, default=str)) if extra else 0)
    limit = max(TEMPLATE_MIN_OUTPUT, TEMPLATE_OUTPUT_FACTOR * size)
    previous = sys.gettrace()
    try:
        template = _compile(source)
        _LIMITS.output = limit
        sys.settrace(_deadline_tracer(time.monotonic() + TEMPLATE_SECONDS))
        parts: list[str] = []
        total = 0
        for piece in template.generate(messages=data, bos_token=bos_token, eos_token=eos_token,
                                       add_generation_prompt=add_generation_prompt, **extra):
            total += len(piece)
            if total > limit:
                raise _TemplateLimit(f"its output passed {limit} characters")
            parts.append(piece)
        return "".join(parts)
    except _TemplateLimit as e:
        raise BadModelFileError(
            f"the model's chat template was stopped: {e}",
            "use a model from a source you trust, or pass --raw to skip the template",
        ) from None
    except SecurityError as e:
        raise BadModelFileError(
            f"the model's chat template tried an unsafe operation and was refused ({e})",
            "use a model from a source you trust, or pass --raw to skip the template",
        ) from e
    except TemplateError as e:
        raise BadModelFileError(
            f"the model's chat template failed: {e}", "pass --raw to skip the template"
        ) from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        # the template's own code failed on these messages (tojson of a generator, ...)
        raise BadModelFileError(
            f"the model's chat template failed: {type(e).__name__}: {e}", "pass --raw to skip the template"
        ) from e
    finally:
        sys.settrace(previous)
        _LIMITS.output = TEMPLATE_MIN_OUTPUT


def thinking_inputs(messages: Sequence[Message], variables: Mapping[str, Any], system_flag: str | None,
                    template_kwargs: Mapping[str, Any]) -> tuple[list[Message], dict[str, Any]]:
    """The messages and extra template variables that switch a thinking model's thought on or off:
    the format's variables (enable_thinking, reasoning_effort...), then the client's own
    chat_template_kwargs, which win; a system flag (/think, /no_think) ends the system prompt,
    or is one when there is none."""
    out = list(messages)
    if system_flag:
        if out and out[0].role == "system":
            first = out[0]
            out[0] = replace(first, content=f"{first.content.rstrip()} {system_flag}".lstrip())
        else:
            out.insert(0, Message("system", system_flag))
    return out, {**variables, **template_kwargs}


def render_plain(messages: Sequence[Message]) -> str:
    """The fallback prompt for models without a chat template."""
    parts = []
    for m in messages:
        if m.role == "system":
            parts.append(f"{m.content}\n")
        else:
            parts.append(f"{'User' if m.role == 'user' else 'Assistant'}: {m.content}\n")
    parts.append("Assistant:")
    return "".join(parts)


class StopMatcher:
    """Streams text while holding back what could be the start of a stop sequence."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.pending = ""
        self.hit: str | None = None  # the stop sequence that ended the text, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """Add generated text; return (text safe to emit, whether a stop sequence was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        first = -1
        for s in self.stops:
            i = self.pending.find(s)
            if i != -1 and (first == -1 or i < first):
                first, self.hit = i, s
        if first != -1:
            out, self.pending = self.pending[:first], ""
            return out, True
        # Keep back the longest suffix that is a prefix of some stop sequence.
        keep = 0
        for k in range(min(self.longest - 1, len(self.pending)), 0, -1):
            tail = self.pending[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out, False

    def flush(self) -> str:
        """Text held back when generation ends without a stop."""
        out, self.pending = self.pending, ""
        return out
