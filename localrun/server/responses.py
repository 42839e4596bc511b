"""OpenAI's Responses API: POST /v1/responses (streamed or whole), GET/DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items, POST /v1/responses/input_tokens.

A request is translated, not run by a pipeline of its own: its input items become chat messages,
its function and custom (freeform) tools become the tools localrun's tool formats render and
constrain, its settings go through settings.resolve, and the reply comes from the same engine
loop and tool parser as the chat API's, written out as Responses items and events
(responses_output.py). Stored responses (response_store.py) let `previous_response_id` continue
a conversation; the engine finds its KV cache again by prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from localrun import api
from localrun.chat import parse_messages
from localrun.errors import ContextOverflowError, LocalrunError, UsageError
from localrun.generation import Request, TokenLogprob
from localrun.server import display_name, errors, image_url, resolve_target
from localrun.server.response_store import ResponseStore, Stored
from localrun.server.responses_mcp import MAX_CALL_ROUNDS, McpTools, error_of, mcp_tools
from localrun.server.responses_output import Output, ToolName, new_id, unsealed_thought
from localrun.server.schemas import LoraRef, SettingsBody, response_constraint, with_settings
from localrun.server.streams import (
    Job,
    Run,
    RunResponse,
    check_images,
    config_of,
    pool_of,
    resolve,
    start_run,
    unless_disconnected,
)
from localrun.settings import GenerationParams
from localrun.tools import ToolPlan
from localrun.tools.freeform import freeform
from localrun.tools.stream import Event

if TYPE_CHECKING:
    from localrun.adapters import Target

router = APIRouter(prefix="/v1")
# Tools OpenAI runs on its own servers (search, code, computers, images): a local model cannot call
# them, so they are left out of what it sees. `mcp` tools run on the servers `serve --mcp` names
# (responses_mcp.py).
HOSTED = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search", "computer",
          "computer_use_preview", "code_interpreter", "image_generation", "local_shell", "shell", "apply_patch",
          "mcp", "tool_search")
_NOTED: set[str] = set()
EFFORTS: dict[str, bool | str] = {"none": False, "minimal": "low", "low": "low", "medium": "medium",
                                  "high": "high", "xhigh": "high", "max": "high"}


# -- the request --------------------------------------------------------------------------------

if TYPE_CHECKING:
    _ResponsesSettings = SettingsBody
else:
    _ResponsesSettings = with_settings("responses", SettingsBody)


class ResponsesRequest(_ResponsesSettings):
    """A Responses API request; temperature, top_p, max_output_tokens and stop are the table's."""

    FRONT: ClassVar[str] = "responses"
    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=0)  # MCP calls run within one response
    user: str | None = None
    lora: list[LoraRef] | None = None  # an extension, as on the chat API

    def settings(self) -> dict[str, Any]:
        given = super().settings()
        if self.top_logprobs is not None or "message.output_text.logprobs" in (self.include or ()):
            given["logprobs"] = self.top_logprobs or 0
        return given

    @property
    def think(self) -> bool | str | None:
        effort = (self.reasoning or {}).get("effort")
        if effort is None:
            return None
        if effort not in EFFORTS:
            raise UsageError(f"invalid reasoning.effort {effort!r}", f"use one of {', '.join(EFFORTS)}", param="reasoning.effort")
        return EFFORTS[effort]

    @property
    def summary(self) -> bool:
        reasoning = self.reasoning or {}
        return bool(reasoning.get("summary") or reasoning.get("generate_summary"))

    def constraint(self) -> Any:
        fmt = (self.text or {}).get("format")
        if not fmt or fmt.get("type") != "json_schema":
            return response_constraint(fmt)
        return response_constraint({"type": "json_schema", "json_schema": fmt})


class InputTokensRequest(ResponsesRequest):
    """POST /v1/responses/input_tokens: what a request's input would cost."""


def store_of(request: HttpRequest) -> ResponseStore:
    return request.app.state.responses  # type: ignore[no-any-return]


# -- tools ------------------------------------------------------------------------------------


def _tools(raw: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]], dict[str, ToolName], list[str]]:
    """The request's tools as function tools (custom ones with their grammar as the pattern of their
    input), what each name the model sees stands for, and notes on grammars not enforced."""
    out: list[dict[str, Any]] = []
    names: dict[str, ToolName] = {}
    notes: list[str] = []

    def add(tool: dict[str, Any], namespace: str | None) -> None:
        kind = tool.get("type")
        if kind in HOSTED:
            return
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise UsageError(f"a {kind} tool needs a name", param="tools")
        seen = f"{namespace}.{name}" if namespace else name
        if kind == "function":
            fn = {"name": seen, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            out.append({"type": "function", "function": fn})
        elif kind == "custom":
            ff = freeform({**tool, "name": seen})
            out.append(ff.function())
            if ff.note:
                notes.append(ff.note)
        else:
            raise UsageError(f"tools of type {kind!r} are not supported", "use function and custom tools", param="tools")
        names[seen] = ToolName("custom" if kind == "custom" else "function", name, namespace)

    for tool in raw or ():
        if not isinstance(tool, dict):
            raise UsageError("each tool must be an object", param="tools")
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or ():
                add(inner, str(tool.get("name") or ""))
        else:
            add(tool, None)
    return out, names, notes


def _choice(raw: Any, tools: list[dict[str, Any]], names: dict[str, ToolName]) -> tuple[Any, list[dict[str, Any]]]:
    """tool_choice in the chat layer's terms, and the tools it allows (allowed_tools narrows them)."""
    if raw is None or isinstance(raw, str):
        return raw, tools
    kind = raw.get("type")
    if kind in ("function", "custom"):
        seen = next((s for s, t in names.items() if t.name == raw.get("name") and t.kind == kind), None)
        if seen is None:
            raise UsageError(f"tool_choice names the {kind} tool {raw.get('name')!r}, which is not in tools",
                             param="tool_choice")
        return {"type": "function", "function": {"name": seen}}, tools
    if kind == "mcp":
        seen = next((s for s, t in names.items() if t.kind == "mcp" and t.namespace == raw.get("server_label")
                     and (raw.get("name") is None or t.name == raw.get("name"))), None)
        if seen is None:
            raise UsageError(f"tool_choice names the mcp tool {raw.get('name')!r} of {raw.get('server_label')!r}, "
                             "which is not among the request's mcp tools", param="tool_choice")
        return ({"type": "function", "function": {"name": seen}} if raw.get("name") else "required"), tools
    if kind == "allowed_tools":
        allowed = {(t.get("type"), t.get("name")) for t in raw.get("tools") or ()}
        keep = [t for t in tools if (names[t["function"]["name"]].kind, names[t["function"]["name"]].name) in allowed]
        return ("required" if raw.get("mode") == "required" else "auto"), keep
    raise UsageError(f"tool_choice of type {kind!r} is not supported here", "use auto, none, required, a "
                     "function or a custom tool", param="tool_choice")


# -- input items -> messages --------------------------------------------------------------------


def _text_of(content: Any, what: str, config: Any) -> tuple[str, list[bytes]]:
    """A message's text and images (its content string or parts)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts: list[str] = []
    images: list[bytes] = []
    for j, part in enumerate(content if isinstance(content, list) else ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text") or ""))
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind == "input_image":
            url = part.get("image_url")
            if url is None and part.get("file_id"):
                raise UsageError(f"{what}: images by file_id are not supported", "send the image as a data URI")
            images.append(image_url(url, f"{what}: image {len(images) + 1}", config))
        else:
            raise UsageError(f"{what}: content part {j} has type {kind!r}",
                             "send input_text, input_image or output_text parts", param="input")
    return "\n".join(texts), images


def conversation(items: list[dict[str, Any]], config: Any, names: dict[str, ToolName],
                 store: ResponseStore | None = None) -> list[dict[str, Any]]:
    """Responses input items as chat messages: system/developer turns, user and assistant turns,
    a reasoning item as the next assistant turn's thought, calls as the assistant's tool calls and
    their outputs as tool turns. System turns after the first user turn become user turns, which
    every template accepts."""
    out: list[dict[str, Any]] = []
    thought: list[str] = []
    seen_names: dict[tuple[Any, Any], str] = {(t.namespace, t.name): s for s, t in names.items()}

    def assistant() -> dict[str, Any]:
        if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
            return out[-1]
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        if thought:
            turn["thinking"] = "".join(thought)
            thought.clear()
        out.append(turn)
        return turn

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise UsageError(f"input item {i} must be an object", param="input")
        kind = item.get("type") or ("message" if "role" in item else None)
        what = f"input item {i}"
        if kind == "item_reference":
            item = _reference(item, store, what)
            kind = item.get("type") or "message"
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user", "assistant"):
                raise UsageError(f"{what} has role {item.get('role')!r}", "use user, assistant, system or developer")
            text, images = _text_of(item.get("content"), what, config)
            if role == "assistant":
                turn = assistant()
                turn["content"] = (turn["content"] + "\n" + text) if turn["content"] else text
                continue
            if role == "system" and any(m["role"] != "system" for m in out):
                role, text = "user", text  # a late system turn: templates take system text first only
            if role == "system" and out and out[-1]["role"] == "system":
                out[-1]["content"] += "\n\n" + text
                continue
            for m in out:
                m["_closed"] = True
            out.append({"role": role, "content": text, **({"images": images} if images else {})})
        elif kind == "reasoning":
            text = "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, dict))
            text = text or unsealed_thought(item.get("encrypted_content")) or \
                "".join(p.get("text", "") for p in item.get("summary") or () if isinstance(p, dict))
            thought.append(text)
        elif kind in ("function_call", "custom_tool_call"):
            name = seen_names.get((item.get("namespace"), item.get("name")), item.get("name"))
            args = item.get("arguments") if kind == "function_call" else json.dumps({"input": item.get("input", "")})
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args or "{}"}}
            turn = assistant()
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "mcp_call":
            name = seen_names.get((item.get("server_label"), item.get("name")), item.get("name"))
            turn = assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": item.get("id"), "type": "function", "function": {"name": name, "arguments": item.get("arguments") or "{}"}})
            for m in out:
                m["_closed"] = True
            out.append({"role": "tool", "tool_call_id": item.get("id"), "content": _mcp_output(item)})
        elif kind in ("mcp_list_tools", "mcp_approval_request", "mcp_approval_response"):
            continue  # listings say nothing to the model; approvals become mcp_call items (_approvals)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text, images = (output, []) if isinstance(output, str) else _text_of(output, what, config)
            for m in out:
                m["_closed"] = True
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text,
                        **({"images": images} if images else {})})
        else:
            raise UsageError(f"{what} has type {kind!r}, which this server does not take", param="input")
    if thought:
        assistant()
    return [{k: v for k, v in m.items() if k != "_closed"} for m in out]


def _mcp_output(item: dict[str, Any]) -> str:
    """What the model reads of an mcp_call: its output, or its error's text."""
    error = item.get("error")
    if not error:
        return str(item.get("output") or "")
    if isinstance(error, dict) and isinstance(error.get("content"), list):
        return " ".join(str(c.get("text", "")) for c in error["content"] if isinstance(c, dict))
    return error if isinstance(error, str) else json.dumps(error)


def _reference(item: dict[str, Any], store: ResponseStore | None, what: str) -> dict[str, Any]:
    """The stored item an item_reference names (an item of a stored response)."""
    found = store.find_item(str(item.get("id"))) if store is not None else None
    if found is None:
        raise UsageError(f"{what}: no stored item has id {item.get('id')!r}", param="input")
    return found


def _input_items(raw: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's input as items with ids (a string is one user message)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]
    return [item if "id" in item or not isinstance(item, dict) else {"id": new_id("item"), **item} for item in raw]


# -- the reply ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Prepared:
    """A request turned into the engine's terms, and what its reply's object needs."""

    target: Target
    request: Request
    params: GenerationParams
    plan: ToolPlan | None
    names: dict[str, ToolName]
    input_items: list[dict[str, Any]]
    parent: Stored | None
    mcp: McpTools | None = None
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # what the model may call
    base: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # system, history, input
    approved: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # calls run on approval


async def _prepare(body: ResponsesRequest, request: HttpRequest) -> _Prepared:
    config = config_of(request)
    target = await asyncio.to_thread(resolve_target, body.model, body.lora, config.lora, config.aliases)
    tools, names, notes = _tools(body.tools)
    for note in notes:
        if note not in _NOTED:  # once per server run: agents send their tools with every request
            _NOTED.add(note)
            print(f"localrun: {note}", file=sys.stderr, flush=True)
    parent = store_of(request).get(body.previous_response_id) if body.previous_response_id else None
    items = _input_items(body.input)
    history = parent.conversation() if parent else []
    listed = {str(i.get("server_label")) for i in history if isinstance(i, dict) and i.get("type") == "mcp_list_tools"}
    mcp = await asyncio.to_thread(mcp_tools, body.tools, request.app.state.mcp, listed)
    if mcp is not None:
        for seen, tool in mcp.tools.items():
            tools.append(tool.function())
            names[seen] = ToolName("mcp", tool.name, tool.server, mcp.approval[seen])
    choice, allowed = _choice(body.tool_choice, tools, names)
    plan = ToolPlan.make(api.chat_template(target.model), allowed, choice, body.parallel_tool_calls)
    params = await resolve(request, target, body.settings(), body.constraint(), plan)
    system = [{"type": "message", "role": "system", "content": body.instructions}] if body.instructions else []
    store = store_of(request)
    approved = await asyncio.to_thread(_approvals, history + items, mcp, store)
    base = system + history + items
    messages = await asyncio.to_thread(
        lambda: parse_messages(conversation(base + approved, config, names, store) or _empty()))
    req = plan.request(messages) if plan else Request(messages=tuple(messages))
    req = dataclasses.replace(req, think=body.think)
    await check_images(request, req, target.model, body.model)
    return _Prepared(target, req, params, plan, names, items, parent, mcp, allowed, base, approved)


def _approvals(items: list[dict[str, Any]], mcp: McpTools | None, store: ResponseStore) -> list[dict[str, Any]]:
    """The mcp_call items of the approval responses among the input items: an approved call run
    now, a refused one told to the model as refused (answered requests are answered once)."""
    requests = {i.get("id"): i for i in items if isinstance(i, dict) and i.get("type") == "mcp_approval_request"}
    done = {i.get("approval_request_id") for i in items if isinstance(i, dict) and i.get("type") == "mcp_call"}
    out: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict) or item.get("type") != "mcp_approval_response":
            continue
        rid = item.get("approval_request_id")
        if rid in done:
            continue
        req = requests.get(rid) or store.find_item(str(rid))
        if req is None or req.get("type") != "mcp_approval_request":
            raise UsageError(f"mcp_approval_response answers {rid!r}, which is no approval request of this "
                             "conversation", "send previous_response_id of the response that asked", param="input")
        call: dict[str, Any] = {"id": new_id("mcp"), "type": "mcp_call", "server_label": req.get("server_label"),
                                "name": req.get("name"), "arguments": req.get("arguments") or "{}",
                                "approval_request_id": rid}
        if not item.get("approve"):
            reason = item.get("reason")
            call.update(output=None, status="failed", error={"type": "mcp_tool_execution_error", "content": [
                {"type": "text", "text": "the user did not approve this call" + (f": {reason}" if reason else "")}]})
        elif mcp is None:
            raise UsageError("an approved mcp call needs its mcp tool in the request's tools", param="tools")
        else:
            seen = next((s for s, t in mcp.tools.items() if t.server == call["server_label"] and t.name == call["name"]),
                        str(call["name"]))
            result = mcp.run(seen, call["arguments"])
            call.update(output=None if result.is_error else result.text, error=error_of(result),
                        status="failed" if result.is_error else "completed")
        done.add(rid)
        out.append(call)
    return out


def _empty() -> list[dict[str, Any]]:
    raise UsageError("the request has no input", "send input, or previous_response_id with input", param="input")


def _response(rid: str, body: ResponsesRequest, prep: _Prepared, created: float, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
              error: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
    p = prep.params
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"id": rid, "object": "response", "created_at": int(created), "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "background": False, "error": error, "incomplete_details": {"reason": reason} if reason else None,
            "instructions": body.instructions, "max_output_tokens": p.max_tokens,
            "model": display_name(prep.target.name), "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": (body.reasoning or {}).get("summary")},
            "store": body.store, "temperature": p.temperature, "text": {"format": fmt},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto", "tools": body.tools or [],
            "top_logprobs": body.top_logprobs, "top_p": p.top_p, "truncation": "disabled", "usage": usage,
            "user": body.user, "metadata": body.metadata or {}}


def _usage(run: Run) -> dict[str, Any]:
    """Token counts: cached_tokens were found in the prefix cache; cache_write_tokens were evaluated
    and stay in it for the next turn."""
    final = run.finals.get(0)
    if final is None:
        return {"input_tokens": 0, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0}
    return {"input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.cached_tokens,
                                     "cache_write_tokens": final.prompt_tokens - final.cached_tokens},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": final.thinking_tokens},
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _status(reason: str | None) -> tuple[str, str | None]:
    if reason == "length":
        return "incomplete", "max_output_tokens"
    if reason == "cancelled":
        return "cancelled", None
    return "completed", None


async def _drive(run: Run, out: Output, plan: ToolPlan | None) -> AsyncIterator[str | None]:
    """Feed the engine's chunks to `out`; yields after each chunk (the final one's reason last)."""
    streamer = plan.streamer() if plan else None

    def write(pieces: list[Event], logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        for piece in pieces:
            if piece[0] == "content":
                out.text(piece[1], logprobs)
            else:
                out.call(piece[1], piece[2], piece[3], piece[4])

    async for _, chunk in run.items():
        if chunk.thinking:
            out.thought(chunk.thinking)
        if not chunk.done:
            write(streamer.feed(chunk.text) if streamer else [("content", chunk.text)], chunk.logprobs)
            yield None
            continue
        write(streamer.flush() if streamer else [])
        yield chunk.finish_reason


class _Steps:
    """The model's runs of one response: it replies again after its MCP calls ran. Holds the
    current run (what a disconnect or a cancel stops) and the token counts of all of them."""

    def __init__(self, request: HttpRequest, body: ResponsesRequest, prep: _Prepared, out: Output) -> None:
        self.request, self.body, self.prep, self.out = request, body, prep, out
        self.run = start_run(request, prep.target, [Job(prep.request, prep.params)], None, stream=True)
        self.runs = [self.run]
        self.reason: str | None = None
        self.calls = 0  # MCP calls run

    async def settle(self) -> None:
        await self.run.settle()

    def close(self) -> None:
        self.run.close()

    def usage(self) -> dict[str, Any]:
        """Every run's tokens together (the cached ones are each run's prompt found in the cache)."""
        total = [_usage(r) for r in self.runs]
        return {"input_tokens": sum(u["input_tokens"] for u in total),
                "input_tokens_details": {k: sum(u["input_tokens_details"][k] for u in total)
                                         for k in ("cached_tokens", "cache_write_tokens")},
                "output_tokens": sum(u["output_tokens"] for u in total),
                "output_tokens_details": {"reasoning_tokens": sum(u["output_tokens_details"]["reasoning_tokens"]
                                                                  for u in total)},
                "total_tokens": sum(u["total_tokens"] for u in total)}

    async def __aiter__(self) -> AsyncIterator[None]:
        """Run to the end, yielding whenever `out` has events to send."""
        for listing in self.prep.mcp.listings if self.prep.mcp else ():
            self.out.mcp_listing(listing)
        for call in self.prep.approved:
            self.out.mcp_done_call(call)
        if self.prep.mcp or self.prep.approved:
            yield
        rounds = 0
        plan = self.prep.plan
        while True:
            await self.run.begin()
            async for r in _drive(self.run, self.out, plan):
                self.reason = r or self.reason
                yield
            cut = self.reason in ("length", "cancelled")
            self.out.finish("incomplete" if self.reason == "length" else "completed")
            pending = self.out.mcp_pending()
            if not pending:
                return
            mcp = self.prep.mcp
            assert mcp is not None
            limit = self.body.max_tool_calls
            for item in pending:
                why = ("the reply ended before the call was complete" if cut else
                       f"max_tool_calls ({limit}) were made" if limit is not None and self.calls >= limit else None)
                if why is not None:
                    self.out.mcp_result(item, None, {"type": "mcp_tool_execution_error",
                                                     "content": [{"type": "text", "text": f"not run: {why}"}]})
                    continue
                self.calls += 1
                result = await asyncio.to_thread(mcp.run, item["_seen"], item["arguments"])
                self.out.mcp_result(item, None if result.is_error else result.text, error_of(result))
                yield
            if cut:
                return
            rounds += 1
            self.reason = None
            done = rounds >= MAX_CALL_ROUNDS or (limit is not None and self.calls >= limit)
            plan = await self._next(done)

    async def _next(self, answer: bool) -> ToolPlan | None:
        """The next run: the conversation with this response's items so far, the tools free (or,
        with `answer`, after MAX_CALL_ROUNDS rounds of calls or max_tool_calls calls, withheld:
        the model must answer)."""
        prep, body = self.prep, self.body
        config, store = config_of(self.request), store_of(self.request)
        done = [_public_item(i) for i in self.out.items]
        messages = await asyncio.to_thread(
            lambda: parse_messages(conversation(prep.base + done, config, prep.names, store)))
        choice = "none" if answer else "auto"
        plan = ToolPlan.make(api.chat_template(prep.target.model), prep.tools, choice, body.parallel_tool_calls)
        params = await resolve(self.request, prep.target, body.settings(), body.constraint(), plan)
        req = plan.request(messages) if plan else Request(messages=tuple(messages))
        req = dataclasses.replace(req, think=body.think)
        self.out.next_step()
        self.run = start_run(self.request, prep.target, [Job(req, params)], None, stream=True)
        self.runs.append(self.run)
        return plan


def _public_item(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if not k.startswith("_")}


@router.post("/responses")
async def create(body: ResponsesRequest, request: HttpRequest) -> Response:
    """A model response to the input, streamed as Server-Sent Events or as one JSON object."""
    prep = await _prepare(body, request)
    rid, created = new_id("resp"), time.time()
    store = store_of(request)
    stored = Stored(_response(rid, body, prep, created, "in_progress", []), prep.input_items, prep.parent)
    if body.store:
        store.put(rid, stored)
    out = Output(prep.names, body.summary, "reasoning.encrypted_content" in (body.include or ()),
                 prep.params.logprobs is not None)
    steps = _Steps(request, body, prep, out)
    stored.cancel = steps.close
    if body.stream:
        return RunResponse(_events(steps, body, prep, rid, created, stored), steps, "text/event-stream")

    async def consume() -> None:
        async for _ in steps:
            out.take()

    try:
        await steps.run.begin()  # errors before the first token are the request's status
        try:
            await unless_disconnected(request, consume(), steps.close)
        finally:
            await asyncio.shield(steps.settle())
    except LocalrunError:
        store.forget(rid)
        raise
    status, why = _status(steps.reason)
    out.finish(status)
    stored.response = _response(rid, body, prep, created, status, out.items, steps.usage(), reason=why)
    stored.cancel = None
    return JSONResponse(stored.response)


def _sse(seq: int, event: dict[str, Any]) -> bytes:
    data = json.dumps({**event, "sequence_number": seq}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _events(steps: _Steps, body: ResponsesRequest, prep: _Prepared, rid: str, created: float,
                  stored: Stored) -> AsyncIterator[bytes]:
    """The stream: created, in_progress, each item's events as it is written, then completed,
    incomplete or (with an error event before it) failed."""
    seq = 0
    out = steps.out

    def send(event: dict[str, Any]) -> bytes:
        nonlocal seq
        seq += 1
        return _sse(seq - 1, event)

    yield send({"type": "response.created", "response": stored.response})
    yield send({"type": "response.in_progress", "response": stored.response})
    try:
        async for _ in steps:
            for event in out.take():
                yield send(event)
    except LocalrunError as e:
        code = _code(e)
        error = {"code": code, "message": str(e)}
        stored.response = _response(rid, body, prep, created, "failed", out.items, None, error)
        stored.cancel = None
        yield send({"type": "error", "code": code, "message": str(e), "param": getattr(e, "param", None)})
        yield send({"type": "response.failed", "response": stored.response})
        return
    status, why = _status(steps.reason)
    out.finish(status)
    for event in out.take():
        yield send(event)
    stored.response = _response(rid, body, prep, created, status, out.items, steps.usage(), reason=why)
    stored.cancel = None
    # OpenAI's stream has no event of its own for a cancelled response: it ends as an incomplete one does
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield send({"type": kind, "response": stored.response})


def _code(error: LocalrunError) -> str:
    """OpenAI's error code for a failure in a stream (context_length_exceeded makes Codex compact)."""
    if isinstance(error, ContextOverflowError):
        return "context_length_exceeded"
    return errors.openai_body(error)["error"]["code"] or "server_error"


# -- stored responses -------------------------------------------------------------------------------


@router.get("/responses/{rid}")
async def retrieve(rid: str, request: HttpRequest) -> dict[str, Any]:
    """A stored response (as it stands: one still generated is in_progress)."""
    return store_of(request).get(rid).response


@router.delete("/responses/{rid}")
async def delete(rid: str, request: HttpRequest) -> dict[str, Any]:
    store_of(request).delete(rid)
    return {"id": rid, "object": "response", "deleted": True}


@router.post("/responses/{rid}/cancel")
async def cancel(rid: str, request: HttpRequest) -> dict[str, Any]:
    """Stop a response that is being generated; it ends with status cancelled."""
    stored = store_of(request).cancel(rid)
    return {**stored.response, "status": "cancelled"}


@router.get("/responses/{rid}/input_items")
async def input_items(rid: str, request: HttpRequest, order: Literal["asc", "desc"] = "desc",
                      limit: int = 20, after: str | None = None) -> dict[str, Any]:
    """The items a stored response was given (its own input, newest first by default)."""
    items = list(store_of(request).get(rid).input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    page = items[:max(1, min(limit, 100))]
    return {"object": "list", "data": page, "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None, "has_more": len(items) > len(page)}


@router.post("/responses/input_tokens")
async def input_tokens(body: InputTokensRequest, request: HttpRequest) -> dict[str, Any]:
    """How many tokens the request's input is, rendered by the model's template with its tools."""
    prep = await _prepare(body, request)
    pool = pool_of(request)

    def count() -> int:
        with api.use_target(pool, prep.target) as (session, _):
            return len(session.tokenize(prep.target.request(prep.request)))

    n = await asyncio.to_thread(count)
    request.state.log = {"model": display_name(prep.target.name)}
    return {"object": "response.input_tokens", "input_tokens": n}
