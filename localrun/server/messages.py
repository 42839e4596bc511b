"""Anthropic's Messages API: POST /v1/messages (streamed or whole, also as ?beta=true), POST
/v1/messages/count_tokens, and GET /v1/models in Anthropic's shape when a request says
`anthropic-version`.

A translation onto the engine loop, as the other APIs are: content blocks become chat messages
(tool_use as tool calls, tool_result as tool turns, thinking blocks as earlier thoughts), tools
the tool formats' calls (forced by grammar for any, tool), settings go through settings.resolve,
and the chunks come back as content blocks and Anthropic's stream events. Claude Code's request
is taken as it sends it; the line it puts first in its system prompt, which changes every request
(`x-anthropic-billing-header: ...; cch=...`), is left out, so the prompt's prefix stays cached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from localrun import api
from localrun.chat import parse_messages
from localrun.errors import LocalrunError, UsageError
from localrun.generation import Chunk, Request
from localrun.server import display_name, image_url, resolve_target
from localrun.server.errors import anthropic_body
from localrun.server.responses_output import new_id, sealed_thought, unsealed_thought
from localrun.server.schemas import SettingsBody, with_settings
from localrun.server.streams import (
    Job,
    Run,
    RunResponse,
    check_images,
    config_of,
    resolve,
    start_run,
)
from localrun.tools import ToolPlan
from localrun.tools.stream import Event

if TYPE_CHECKING:
    from localrun.adapters import Target
    from localrun.settings import GenerationParams

router = APIRouter(prefix="/v1")
# The first line of Claude Code's system prompt, different on every request (a nonce, cch=...):
# it says who sends the request and nothing the model needs.
BILLING = re.compile(r"^x-anthropic-billing-header:[^\n]*\n?", re.M)
# Server tools Anthropic runs itself (search, code, computers...): a local model cannot call them.
SERVER_TOOLS = ("web_search", "web_fetch", "code_execution", "computer", "bash", "text_editor", "memory",
                "tool_search")
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


if TYPE_CHECKING:
    _AnthropicSettings = SettingsBody
else:
    _AnthropicSettings = with_settings("anthropic", SettingsBody)


class MessagesRequest(_AnthropicSettings):
    """A Messages API request; max_tokens, temperature, top_p, top_k and stop_sequences are the table's."""

    FRONT: ClassVar[str] = "anthropic"
    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False

    def settings(self) -> dict[str, Any]:
        given = super().settings()
        kind = (self.thinking or {}).get("type")
        if kind == "enabled" and (self.thinking or {}).get("budget_tokens") is not None:
            budget = self.thinking["budget_tokens"] if self.thinking else None
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                raise UsageError(f"invalid thinking.budget_tokens: {budget!r}", "expected an integer >= 0",
                                 param="thinking.budget_tokens")
            given["think_budget"] = budget
        return given

    @property
    def think(self) -> bool | str | None:
        kind = (self.thinking or {}).get("type")
        if kind == "disabled":
            return False
        effort = (self.output_config or {}).get("effort")
        if effort is not None:
            if effort not in EFFORTS:
                raise UsageError(f"invalid output_config.effort {effort!r}", f"use one of {', '.join(EFFORTS)}")
            return EFFORTS[effort]
        if kind == "enabled":
            return True
        return None  # adaptive, or not said: the template's own default

    def constraint(self) -> Any:
        fmt = (self.output_config or {}).get("format")
        if not fmt:
            return None
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise UsageError("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}")
        from localrun.constraint import Constraint

        return Constraint.schema(fmt["schema"], "output_config.format schema")

    @property
    def caching(self) -> bool:
        """Whether the request marks cache breakpoints (cache_control), as Claude Code does."""
        return "cache_control" in json.dumps([self.system, self.messages[-1:], self.tools])


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: the same fields, max_tokens not needed."""


# -- the request in localrun's terms ---------------------------------------------------------------


def _tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(raw or ()):
        kind = str(tool.get("type") or "custom")
        if kind != "custom" and kind.rsplit("_", 1)[0] in SERVER_TOOLS:
            continue
        name = tool.get("name")
        if not isinstance(name, str):
            raise UsageError(f"tools.{i} needs a name", param=f"tools.{i}.name")
        fn: dict[str, Any] = {"name": name, "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _choice(raw: dict[str, Any] | None) -> tuple[Any, bool]:
    """tool_choice in the chat layer's terms, and whether several calls may come in one reply."""
    if raw is None:
        return None, True
    kind = raw.get("type")
    parallel = not raw.get("disable_parallel_tool_use", False)
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"type": "function", "function": {"name": raw.get("name")}}, parallel
    raise UsageError(f"invalid tool_choice type {kind!r}", "use auto, any, tool or none", param="tool_choice")


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise UsageError("a message's content must be a string or a list of blocks")
    return content


def _image(block: dict[str, Any], what: str, config: Any) -> bytes:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return image_url(f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}", what, config)
    if source.get("type") == "url":
        return image_url(source.get("url"), what, config)
    raise UsageError(f"{what}: image source {source.get('type')!r} is not supported", "send base64 or a url")


def _system(raw: str | list[dict[str, Any]] | None) -> str:
    text = raw if isinstance(raw, str) else "\n\n".join(b.get("text", "") for b in raw or () if b.get("type") == "text")
    return BILLING.sub("", text).strip("\n")


def conversation(body: MessagesRequest, config: Any) -> list[dict[str, Any]]:
    """The request as chat messages: its system prompt, then each message's blocks in order (a
    tool_result is a tool turn; a system message after the first turn becomes a user turn, which
    every template takes)."""
    out: list[dict[str, Any]] = []
    system = _system(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        role = m.get("role")
        what = f"messages.{i}"
        if role == "system":
            text = _system(m.get("content"))
            if text:
                out.append({"role": "system" if not out or all(x["role"] == "system" for x in out) else "user",
                            "content": text})
            continue
        if role not in ("user", "assistant"):
            raise UsageError(f"{what} has role {role!r}", "use user or assistant", param=f"{what}.role")
        texts: list[str] = []
        images: list[bytes] = []
        thought: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(m.get("content"))):
            kind = block.get("type")
            where = f"{what}.content.{j}"
            if kind == "text":
                texts.append(str(block.get("text") or ""))
            elif kind == "image":
                images.append(_image(block, where, config))
            elif kind == "thinking" and role == "assistant":
                thought.append(str(block.get("thinking") or ""))
            elif kind == "redacted_thinking" and role == "assistant":
                thought.append(unsealed_thought(block.get("data")) or "")
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                result, result_images = _result(block, where, config)
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result,
                            **({"images": result_images} if result_images else {})})
            elif kind in ("document", "search_result", "container_upload"):
                raise UsageError(f"{where}: {kind} blocks are not supported", "send text and images",
                                 param=f"{where}.type")
            elif kind not in ("server_tool_use", "web_search_tool_result", "thinking", "redacted_thinking"):
                raise UsageError(f"{where} has type {kind!r}", param=f"{where}.type")
        if role == "assistant":
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if thought:
                turn["thinking"] = "".join(thought)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
        elif texts or images:
            out.append({"role": "user", "content": "\n".join(texts), **({"images": images} if images else {})})
    return out


def _result(block: dict[str, Any], where: str, config: Any) -> tuple[str, list[bytes]]:
    content = block.get("content")
    texts: list[str] = []
    images: list[bytes] = []
    for part in _blocks(content) if content is not None else ():
        if part.get("type") == "text":
            texts.append(str(part.get("text") or ""))
        elif part.get("type") == "image":
            images.append(_image(part, where, config))
    text = "\n".join(texts)
    return (f"Error: {text}" if block.get("is_error") else text), images


@dataclasses.dataclass
class _Prepared:
    target: Target
    request: Request
    params: GenerationParams
    plan: ToolPlan | None


async def _prepare(body: MessagesRequest, request: HttpRequest) -> _Prepared:
    config = config_of(request)
    target = await asyncio.to_thread(resolve_target, body.model, None, config.lora, config.aliases)
    choice, parallel = _choice(body.tool_choice)
    plan = ToolPlan.make(api.chat_template(target.model), _tools(body.tools), choice, parallel)
    params = await resolve(request, target, body.settings(), body.constraint(), plan)
    messages = await asyncio.to_thread(lambda: parse_messages(conversation(body, config)))
    req = plan.request(messages) if plan else Request(messages=tuple(messages))
    req = dataclasses.replace(req, think=body.think)
    await check_images(request, req, target.model, body.model)
    return _Prepared(target, req, params, plan)


# -- the reply ------------------------------------------------------------------------------------


class _Blocks:
    """A reply's content blocks as they are generated, and the stream events that announce them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._open: int | None = None  # the index of the block being written
        self._calls: dict[int, int] = {}  # the parser's call index -> block index
        self._args: dict[int, str] = {}

    def _start(self, block: dict[str, Any]) -> int:
        self._stop()
        self.blocks.append(block)
        self._open = len(self.blocks) - 1
        shown = {**block, **({"input": {}} if block["type"] == "tool_use" else {})}
        if block["type"] == "text":
            shown["text"] = ""
        elif block["type"] == "thinking":
            shown.update(thinking="", signature="")
        self.events.append(("content_block_start", {"index": self._open, "content_block": shown}))
        return self._open

    def _stop(self) -> None:
        if self._open is None:
            return
        at, self._open = self._open, None
        block = self.blocks[at]
        if block["type"] == "thinking":
            block["signature"] = sealed_thought(block["thinking"])
            self.events.append(("content_block_delta", {"index": at, "delta": {"type": "signature_delta",
                                                                               "signature": block["signature"]}}))
        elif block["type"] == "tool_use":
            args = self._args.pop(at, "") or "{}"
            try:
                block["input"] = json.loads(args)
            except ValueError:
                block["input"] = {}
        self.events.append(("content_block_stop", {"index": at}))

    def thought(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self.blocks[self._open]["type"] != "thinking":
            self._start({"type": "thinking", "thinking": "", "signature": ""})
        assert self._open is not None
        self.blocks[self._open]["thinking"] += text
        self.events.append(("content_block_delta", {"index": self._open,
                                                    "delta": {"type": "thinking_delta", "thinking": text}}))

    def text(self, text: str) -> None:
        if not text:
            return
        if self._open is None or self.blocks[self._open]["type"] != "text":
            self._start({"type": "text", "text": ""})
        assert self._open is not None
        self.blocks[self._open]["text"] += text
        self.events.append(("content_block_delta", {"index": self._open, "delta": {"type": "text_delta", "text": text}}))

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> None:
        if index not in self._calls:
            self._calls[index] = self._start({"type": "tool_use", "id": call_id or new_id("toolu"), "name": name or "",
                                              "input": {}})
            self._args[self._calls[index]] = ""
        at = self._calls[index]
        if arguments:
            self._args[at] = self._args.get(at, "") + arguments
            self.events.append(("content_block_delta", {"index": at, "delta": {"type": "input_json_delta",
                                                                                "partial_json": arguments}}))

    def finish(self) -> None:
        self._stop()

    def take(self) -> list[tuple[str, dict[str, Any]]]:
        events, self.events = self.events, []
        return events

    @property
    def called(self) -> bool:
        return bool(self._calls)


def _usage(final: Chunk | None, caching: bool) -> dict[str, int]:
    """Token counts as Anthropic counts them: cache_read_input_tokens were found in the prefix
    cache; the tokens evaluated now stay cached too, so with cache breakpoints in the request they
    are cache_creation_input_tokens, and without them input_tokens. The three add up to the prompt."""
    if final is None:
        return {"input_tokens": 0, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    fresh = final.prompt_tokens - final.cached_tokens
    return {"input_tokens": 0 if caching else fresh, "output_tokens": final.completion_tokens,
            "cache_read_input_tokens": final.cached_tokens, "cache_creation_input_tokens": fresh if caching else 0}


def _stop_reason(final: Chunk | None, called: bool) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if final is not None and final.finish_reason == "length":
        return "max_tokens", None
    if final is not None and final.stop_sequence is not None:
        return "stop_sequence", final.stop_sequence
    return "end_turn", None


async def _drive(run: Run, out: _Blocks, plan: ToolPlan | None) -> AsyncIterator[Chunk]:
    streamer = plan.streamer() if plan else None

    def write(pieces: list[Event]) -> None:
        for piece in pieces:
            if piece[0] == "content":
                out.text(piece[1])
            else:
                out.call(piece[1], piece[2], piece[3], piece[4])

    async for _, item in run.items():
        if item.thinking:
            out.thought(item.thinking)
        if not item.done:
            write(streamer.feed(item.text) if streamer else [("content", item.text)])
        else:
            write(streamer.flush() if streamer else [])
            out.finish()
        yield item


def _message(mid: str, model: str, blocks: list[dict[str, Any]], final: Chunk | None, called: bool,
             caching: bool) -> dict[str, Any]:
    reason, sequence = _stop_reason(final, called)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(final, caching)}


@router.post("/messages")
async def create(body: MessagesRequest, request: HttpRequest) -> Response:
    """The assistant's next message, streamed as Server-Sent Events or as one JSON object."""
    if getattr(body, "max_tokens", None) is None:  # required by the Messages API
        raise UsageError("max_tokens: Field required", param="max_tokens")
    prep = await _prepare(body, request)
    run = start_run(request, prep.target, [Job(prep.request, prep.params)], None, stream=True, report=body.stream)
    mid, name = new_id("msg"), display_name(prep.target.name)
    out = _Blocks()
    await run.begin()  # a prompt past the context is a 400 here, before any event
    if body.stream:
        return RunResponse(_events(run, out, prep, mid, name, body.caching), run, "text/event-stream")
    final: Chunk | None = None

    async def consume() -> None:
        nonlocal final
        async for item in _drive(run, out, prep.plan):
            if isinstance(item, Chunk) and item.done:
                final = item

    await run.complete(consume())
    return JSONResponse(_message(mid, name, out.blocks, final, out.called, body.caching))


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()


async def _events(run: Run, out: _Blocks, prep: _Prepared, mid: str, name: str, caching: bool) -> AsyncIterator[bytes]:
    """message_start, a ping, each block's start, deltas and stop, message_delta (stop reason and
    the final counts), message_stop; a failure is an error event in Anthropic's shape."""
    started = False
    final: Chunk | None = None
    try:
        async for item in _drive(run, out, prep.plan):
            if not started:  # the first chunk: the engine took the request, with its counts
                head = _message(mid, name, [], item, False, caching)
                yield _sse("message_start", {"message": {**head, "stop_reason": None, "usage": {
                    **_usage(item, caching), "output_tokens": 0}}})
                yield _sse("ping", {})
                started = True
            for kind, data in out.take():
                yield _sse(kind, data)
            if item.done:
                final = item
    except LocalrunError as e:
        yield _sse("error", anthropic_body(e))
        return
    if not started:
        return
    reason, sequence = _stop_reason(final, out.called)
    yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": _usage(final, caching)})
    yield _sse("message_stop", {})


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: HttpRequest) -> dict[str, int]:
    """The tokens of the request's prompt (system, messages and tools, as the template renders them)."""
    prep = await _prepare(body, request)
    pool = request.app.state.pool

    def count() -> int:
        with api.use_target(pool, prep.target) as (session, _):
            return len(session.tokenize(prep.target.request(prep.request)))

    n = await asyncio.to_thread(count)
    request.state.log = {"model": display_name(prep.target.name)}
    return {"input_tokens": n}


def models(listed: list[Any]) -> dict[str, Any]:
    """GET /v1/models in Anthropic's shape (a client that sends anthropic-version gets this)."""
    data = [{"type": "model", "id": display_name(m.name), "display_name": display_name(m.name),
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(0))} for m in listed]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
