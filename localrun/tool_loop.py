"""A model that uses tools: its calls are checked against each tool's input schema, allowed by
the user (or not), run on their MCP servers, and their results fed back as the chat template
expects, until the model answers or the step limit is reached.

The loop is the same for every front end (`run`, the TUI, `batch`, the server): the front end
gives it a way to generate one reply (streaming it wherever it shows replies) and a way to ask
the user; nothing runs that was not allowed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from localrun.tool_servers import CallResult, ServerTool, ToolServers
from localrun.tools import ToolCall

if TYPE_CHECKING:
    from localrun.tools import ToolPlan

MAX_STEPS = 8  # replies with calls before the model must answer
REFUSED = "the user did not allow this call"  # what the model reads of a call nobody allowed

Answer = Literal["once", "always", "no", "never"]


class Ask(Protocol):
    """Asks the user whether one call may run: once, always for this tool, no, or never for it."""

    def __call__(self, tool: ServerTool, arguments: dict[str, Any]) -> Answer: ...


class Approvals:
    """Which calls may run: tools allowed ahead (--allow-tools NAME,...|all, or a tool's
    `server/name`), the answers given this session, and a way to ask for the rest (none: a
    call nobody allowed is refused)."""

    def __init__(self, allowed: Iterable[str] = (), ask: Ask | None = None) -> None:
        names = {a.strip() for a in allowed if a.strip()}
        self.all = "all" in names
        self.allowed = names - {"all"}
        self.denied: set[str] = set()
        self.ask = ask

    @staticmethod
    def keys(tool: ServerTool) -> set[str]:
        return {tool.name, tool.model_name or tool.name, f"{tool.server}/{tool.name}", tool.server}

    def allows(self, tool: ServerTool, arguments: dict[str, Any]) -> bool:
        keys = self.keys(tool)
        if keys & self.denied:
            return False
        if self.all or keys & self.allowed:
            return True
        if self.ask is None:
            return False
        answer = self.ask(tool, arguments)
        if answer == "always":
            self.allowed.add(f"{tool.server}/{tool.name}")
        elif answer == "never":
            self.denied.add(f"{tool.server}/{tool.name}")
        return answer in ("once", "always")


@dataclass
class ToolUse:
    """One call the model made, and what came of it."""

    id: str
    server: str
    tool: str
    arguments: Any  # the parsed arguments (or the text the model wrote, when it is not JSON)
    result: str
    is_error: bool
    allowed: bool
    seconds: float  # the tool's own time, on its server
    overhead_ms: float = 0.0  # from the call parsed to its result ready, without the tool's time or the user's
    refused: bool = False  # the user (or --allow-tools) did not allow it: it never ran

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "server": self.server, "tool": self.tool, "arguments": self.arguments,
                "result": self.result, "is_error": self.is_error, "allowed": self.allowed, "refused": self.refused,
                "seconds": round(self.seconds, 4), "overhead_ms": round(self.overhead_ms, 3)}


@dataclass
class Reply:
    """One generated reply: its text with the calls taken out, the calls, and what the front end
    keeps of it (the final chunk, the thought)."""

    text: str
    calls: list[ToolCall]
    final: Any = None
    thinking: str = ""

    @classmethod
    def of(cls, plan: ToolPlan, text: str, final: Any = None, thinking: str = "", stopped: bool = False) -> Reply:
        """A step's generated text read by its plan: the text without the calls, and the calls,
        none under "none" (the step limit: calls the model still writes are dropped) or in a reply
        that was stopped."""
        content, calls = plan.format.parse(text)
        stopped = stopped or (final is not None and final.finish_reason == "cancelled")
        return cls(content, [] if plan.choice == "none" or stopped else calls, final, thinking)


@dataclass
class Outcome:
    """The loop's end: the last reply, every call made, and the conversation with them in it."""

    reply: Reply
    uses: list[ToolUse] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0


Generate = Callable[[list[dict[str, Any]], str], Reply]


_VALIDATORS: dict[str, Any] = {}  # a schema's JSON -> its checked, compiled validator (or None: a bad schema)


def _validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    text = json.dumps(schema, sort_keys=True)
    if text not in _VALIDATORS:
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
            _VALIDATORS[text] = cls(schema)
        except jsonschema.SchemaError:
            _VALIDATORS[text] = None  # the server's schema is its own business; the server checks its input
    return _VALIDATORS[text]


def check_arguments(tool: ServerTool, arguments: Any) -> str | None:
    """Why these arguments do not fit the tool's input schema (None: they fit)."""
    if not isinstance(arguments, dict):
        return "the arguments must be a JSON object"
    validator = _validator(tool.schema)
    if validator is None:
        return None
    error = next(iter(sorted(validator.iter_errors(arguments), key=lambda e: e.path)), None)
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"invalid arguments{f' at {where}' if where else ''}: {error.message}"


class ToolLoop:
    """Runs a chat whose model may call the tools of some MCP servers."""

    def __init__(self, servers: ToolServers, approvals: Approvals, tools: list[ServerTool], *,
                 max_steps: int = MAX_STEPS, on_use: Callable[[ToolUse], None] | None = None,
                 on_call: Callable[[ServerTool, dict[str, Any]], None] | None = None) -> None:
        self.servers = servers
        self.approvals = approvals
        self.tools = {t.model_name or t.name: t for t in tools}
        self.max_steps = max_steps
        self.on_use = on_use  # after each call (shown as it happens)
        self.on_call = on_call  # before a call that runs (a front end shows it is running)
        import jsonschema  # noqa: F401 - loaded here, not inside the first call's time

    def functions(self) -> list[dict[str, Any]]:
        """The tools as OpenAI function tools, for ToolPlan."""
        return [t.function() for t in self.tools.values()]

    def run(self, generate: Generate, messages: list[dict[str, Any]], choice: str = "auto") -> Outcome:
        """Generate, run the calls, feed the results back; again until a reply has no calls. The
        first reply is held to `choice` (e.g. "required"), the later ones are free ("auto"); at the
        step limit the model answers without tools ("none")."""
        msgs = list(messages)
        uses: list[ToolUse] = []
        step = 0
        while True:
            step_choice = choice if step == 0 else "auto"
            if step >= self.max_steps:
                step_choice = "none"
            reply = generate(msgs, step_choice)
            if not reply.calls or step_choice == "none":
                return Outcome(reply, uses, msgs, step)
            step += 1
            turn: dict[str, Any] = {"role": "assistant", "content": reply.text,
                                    "tool_calls": [c.to_openai() for c in reply.calls]}
            if reply.thinking:
                turn["thinking"] = reply.thinking
            msgs.append(turn)
            for call in reply.calls:
                use = self.use(call)
                uses.append(use)
                msgs.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": use.result})

    def use(self, call: ToolCall) -> ToolUse:
        """Check, allow and run one call; every way it can fail is a result the model reads."""
        t0 = time.perf_counter()
        waited = 0.0
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            use = ToolUse(call.id, "", call.name, call.arguments, f"there is no tool '{call.name}'; the tools are: "
                          f"{known}", True, False, 0.0)
        elif (problem := check_arguments(tool, call.arguments)) is not None:
            use = ToolUse(call.id, tool.server, tool.name, call.arguments, problem, True, False, 0.0)
        else:
            asked = time.perf_counter()
            allowed = self.approvals.allows(tool, call.arguments)
            waited = time.perf_counter() - asked
            if not allowed:
                use = ToolUse(call.id, tool.server, tool.name, call.arguments,
                              REFUSED, True, False, 0.0, refused=True)
            else:
                if self.on_call is not None:
                    self.on_call(tool, call.arguments)
                result: CallResult = self.servers.call(tool, call.arguments)
                use = ToolUse(call.id, tool.server, tool.name, call.arguments, result.text, result.is_error, True,
                              result.seconds)
        use.overhead_ms = max(0.0, (time.perf_counter() - t0 - waited - use.seconds) * 1000)
        if self.on_use is not None:
            self.on_use(use)
        return use


def describe(use: ToolUse, width: int = 200) -> str:
    """One line for a call: tool, arguments, result (shortened), time."""
    args = json.dumps(use.arguments, ensure_ascii=False) if not isinstance(use.arguments, str) else use.arguments
    result = " ".join(use.result.split())
    if len(result) > width:
        result = result[: width - 3] + "..."
    where = f"{use.server}/{use.tool}" if use.server else use.tool
    state = "error: " if use.is_error else ""
    return f"{where}({args}) -> {state}{result} [{use.seconds * 1000:.0f} ms]"
