"""A Responses API reply as it is generated: its output items (reasoning, message, function and
custom tool calls) and the stream events that announce them, in the order and shape OpenAI
sends them. The engine's chunks and the tool parser's deltas go in; items and events come out."""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass
from typing import Any

from localrun.generation import TokenLogprob
from localrun.tools.freeform import INPUT, InputStream

THOUGHT_PREFIX = "localrun:"  # an encrypted_content of ours: the thought itself, base64


@dataclass(frozen=True)
class ToolName:
    """What a tool the model sees was in the request: a function or a custom (freeform) tool,
    maybe inside a namespace (the model sees `namespace.name`)."""

    kind: str  # "function", "custom" or "mcp" (a tool of an MCP server: namespace is its label)
    name: str
    namespace: str | None = None
    approval: bool = False  # an mcp tool whose calls wait for the client's approval


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sealed_thought(text: str) -> str:
    """A thought as the `encrypted_content` a client keeps and sends back (not secret: opaque)."""
    return THOUGHT_PREFIX + base64.b64encode(text.encode()).decode()


def unsealed_thought(value: Any) -> str | None:
    """The thought in an `encrypted_content` of ours; None for anything else (another server's)."""
    if not isinstance(value, str) or not value.startswith(THOUGHT_PREFIX):
        return None
    try:
        return base64.b64decode(value[len(THOUGHT_PREFIX):]).decode()
    except ValueError:
        return None


def _logprob(t: TokenLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
            "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top]}


class Output:
    """One reply's output items and its pending stream events (without sequence numbers: the
    stream numbers them as it sends them)."""

    def __init__(self, names: dict[str, ToolName], summary: bool, seal: bool, logprobs: bool) -> None:
        self.names = names
        self.summary, self.seal, self.logprobs = summary, seal, logprobs
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._thought: int | None = None  # index of the open reasoning item
        self._message: int | None = None  # index of the open message item
        self._calls: dict[int, int] = {}  # the parser's call index -> item index
        self._args: dict[int, str] = {}  # item index -> the call's JSON arguments so far
        self._inputs: dict[int, InputStream] = {}  # item index -> a custom call's input decoder
        self._pending: list[int] = []  # mcp_call items whose calls have not run yet
        self.text_parts: list[str] = []

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    # -- reasoning -----------------------------------------------------------------------
    def thought(self, text: str) -> None:
        if not text:
            return
        if self._thought is None:
            self._close_message()
            item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            self._thought = self._add(item)
            self._event("response.content_part.added", item, content_index=0,
                        part={"type": "reasoning_text", "text": ""})
            if self.summary:
                self._event("response.reasoning_summary_part.added", item, summary_index=0,
                            part={"type": "summary_text", "text": ""})
        item = self.items[self._thought]
        item["_text"] = item.get("_text", "") + text
        self._event("response.reasoning_text.delta", item, content_index=0, delta=text)
        if self.summary:
            self._event("response.reasoning_summary_text.delta", item, summary_index=0, delta=text)

    def _close_thought(self) -> None:
        if self._thought is None:
            return
        item = self.items[self._thought]
        text = item.pop("_text", "")
        self._thought = None
        part = {"type": "reasoning_text", "text": text}
        self._event("response.reasoning_text.done", item, content_index=0, text=text)
        self._event("response.content_part.done", item, content_index=0, part=part)
        item["content"] = [part]
        if self.summary:
            summary = {"type": "summary_text", "text": text}
            self._event("response.reasoning_summary_text.done", item, summary_index=0, text=text)
            self._event("response.reasoning_summary_part.done", item, summary_index=0, part=summary)
            item["summary"] = [summary]
        if self.seal:
            item["encrypted_content"] = sealed_thought(text)
        self._done(item)

    # -- text ----------------------------------------------------------------------------
    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        if not text and not logprobs:
            return
        self._close_thought()
        if self._message is None:
            item: dict[str, Any] = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                                    "role": "assistant", "content": []}
            self._message = self._add(item)
            self._event("response.content_part.added", item, content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            item["_text"], item["_lps"] = [], []
        item = self.items[self._message]
        lps = [_logprob(t) for t in logprobs] if self.logprobs else []
        item["_text"].append(text)
        item["_lps"] += lps
        self.text_parts.append(text)
        self._event("response.output_text.delta", item, content_index=0, delta=text, logprobs=lps)

    def _close_message(self, status: str = "completed") -> None:
        if self._message is None:
            return
        item = self.items[self._message]
        self._message = None
        text, lps = "".join(item.pop("_text")), item.pop("_lps")
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
        self._event("response.output_text.done", item, content_index=0, text=text, logprobs=lps)
        self._event("response.content_part.done", item, content_index=0, part=part)
        item.update(content=[part], status=status)
        self._done(item)

    # -- tool calls ------------------------------------------------------------------------
    def call(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> None:
        """A piece of the parser's call `index`: its start (id and name), then its arguments' JSON."""
        if index not in self._calls:
            self._close_thought()
            self._close_message()
            tool = self.names.get(name or "", ToolName("function", name or ""))
            cid = call_id or new_id("call")
            if tool.kind == "mcp" and tool.approval:
                item: dict[str, Any] = {"id": new_id("mcpr"), "type": "mcp_approval_request",
                                        "server_label": tool.namespace, "name": tool.name, "arguments": ""}
            elif tool.kind == "mcp":
                item = {"id": new_id("mcp"), "type": "mcp_call", "server_label": tool.namespace, "name": tool.name,
                        "arguments": "", "status": "in_progress", "_seen": name}
            elif tool.kind == "custom":
                item = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": cid,
                        "name": tool.name, "input": ""}
            else:
                item = {"id": new_id("fc"), "type": "function_call", "call_id": cid, "name": tool.name,
                        "arguments": "", "status": "in_progress"}
            if tool.namespace and tool.kind != "mcp":
                item["namespace"] = tool.namespace
            at = self._calls[index] = self._add(item)
            if item["type"] == "mcp_call":
                self._event("response.mcp_call.in_progress", item)
            self._args[at] = ""
            if tool.kind == "custom":
                self._inputs[at] = InputStream()
        at = self._calls[index]
        item = self.items[at]
        if not arguments:
            return
        self._args[at] += arguments
        if item["type"] == "custom_tool_call":
            delta = self._inputs[at].feed(arguments)
            if delta:
                self._event("response.custom_tool_call_input.delta", item, delta=delta)
        elif item["type"] == "mcp_call":
            self._event("response.mcp_call_arguments.delta", item, delta=arguments)
        elif item["type"] == "function_call":
            self._event("response.function_call_arguments.delta", item, delta=arguments)

    def _close_calls(self) -> None:
        for at in self._calls.values():
            item = self.items[at]
            if item.get("status") == "completed" or at not in self._args:
                continue
            args = self._args.pop(at) or "{}"
            if item["type"] == "custom_tool_call":
                try:
                    value = json.loads(args).get(INPUT, "")
                except (ValueError, AttributeError):
                    value = ""
                item["input"] = value if isinstance(value, str) else json.dumps(value)
                self._event("response.custom_tool_call_input.done", item, input=item["input"])
            elif item["type"] == "mcp_call":  # done once it has run (mcp_results)
                item["arguments"] = args
                self._event("response.mcp_call_arguments.done", item, arguments=args)
                self._pending.append(at)
                continue
            elif item["type"] == "mcp_approval_request":
                item["arguments"] = args
            else:
                item.update(arguments=args, status="completed")
                self._event("response.function_call_arguments.done", item, arguments=args)
            self._done(item)

    # -- MCP tools --------------------------------------------------------------------------
    def mcp_listing(self, listing: dict[str, Any]) -> None:
        """An mcp_list_tools item: the tools of one server, or why it has none."""
        item = {"id": new_id("mcpl"), **listing, "tools": []}
        self._add(item)
        self._event("response.mcp_list_tools.in_progress", item)
        item["tools"] = listing.get("tools") or []
        failed = bool(listing.get("error"))
        self._event("response.mcp_list_tools.failed" if failed else "response.mcp_list_tools.completed", item)
        self._done(item)

    def mcp_pending(self) -> list[dict[str, Any]]:
        """The mcp_call items whose calls are to run (their arguments complete)."""
        return [self.items[at] for at in self._pending]

    def mcp_result(self, item: dict[str, Any], output: str | None, error: dict[str, Any] | None) -> None:
        """A call has run: its output (or error) goes in, and the item is done."""
        self._pending.remove(self.items.index(item))
        item.update(output=output, error=error, status="failed" if error else "completed")
        self._event("response.mcp_call.failed" if error else "response.mcp_call.completed", item)
        self._done(item)

    def mcp_done_call(self, item: dict[str, Any]) -> None:
        """An mcp_call made outside the model's reply (an approved request run): added whole."""
        self._add(item)
        self._event("response.mcp_call.in_progress", item)
        self._event("response.mcp_call_arguments.done", item, arguments=item["arguments"])
        self._event("response.mcp_call.failed" if item.get("error") else "response.mcp_call.completed", item)
        self._done(item)

    def next_step(self) -> None:
        """The model replies again after its calls ran: the parser's call indexes start over."""
        self._calls.clear()
        self._args.clear()
        self._inputs.clear()

    # -- the end ---------------------------------------------------------------------------
    def finish(self, status: str = "completed") -> None:
        """Close every open item (a reply cut short leaves its message incomplete)."""
        self._close_thought()
        self._close_message("incomplete" if status == "incomplete" else "completed")
        self._close_calls()

    def output_text(self) -> str:
        return "".join(self.text_parts)

    def _add(self, item: dict[str, Any]) -> int:
        self.items.append(item)
        at = len(self.items) - 1
        self.events.append({"type": "response.output_item.added", "output_index": at, "item": _public(item)})
        return at

    def _done(self, item: dict[str, Any]) -> None:
        self.events.append({"type": "response.output_item.done", "output_index": self.items.index(item),
                            "item": _public(item)})

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> None:
        self.events.append({"type": kind, "item_id": item["id"], "output_index": self.items.index(item), **fields})


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """An item as clients see it (without the builder's own fields, which start with _)."""
    return {k: (list(v) if isinstance(v, list) else v) for k, v in item.items() if not k.startswith("_")}
