"""The Responses API's `mcp` tools, on the MCP servers `serve --mcp FILE` names: a request picks
servers by `server_label` (a request never starts a process or reaches a URL the server's owner
did not list), their tools are listed (`mcp_list_tools`), the model's calls run on them within
the response (`mcp_call`) or wait for the client's approval (`mcp_approval_request`, answered by
an `mcp_approval_response` input item), as OpenAI's API does it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from localrun.errors import UsageError
from localrun.tool_loop import check_arguments
from localrun.tool_servers import CallResult, ServerTool, ToolServers

MAX_CALL_ROUNDS = 8  # rounds of calls within one response before the model must answer


@dataclass
class McpTools:
    """A request's mcp tools: what the model sees of each, and which calls need approval."""

    servers: ToolServers
    tools: dict[str, ServerTool] = field(default_factory=dict)  # the name the model sees -> the tool
    approval: dict[str, bool] = field(default_factory=dict)  # the name the model sees -> needs approval
    listings: list[dict[str, Any]] = field(default_factory=list)  # mcp_list_tools items this response adds

    def functions(self) -> list[dict[str, Any]]:
        return [t.function() for t in self.tools.values()]

    def run(self, name: str, arguments: str) -> CallResult:
        """One call by the name the model sees, its arguments as JSON text; failures are results."""
        tool = self.tools.get(name)
        if tool is None:
            return CallResult(f"there is no tool '{name}'", True, 0.0)
        try:
            args = json.loads(arguments or "{}")
        except ValueError as e:
            return CallResult(f"the arguments are not JSON: {e}", True, 0.0)
        problem = check_arguments(tool, args)
        if problem is not None:
            return CallResult(problem, True, 0.0)
        return self.servers.call(tool, args)


def _names(value: Any) -> set[str] | None:
    """allowed_tools / require_approval's tool_names: a list, or {"tool_names": [...]}."""
    if value is None:
        return None
    if isinstance(value, list):
        return {str(v) for v in value}
    if isinstance(value, dict):
        names = value.get("tool_names")
        return {str(v) for v in names} if isinstance(names, list) else set()
    raise UsageError("allowed_tools must be a list of tool names or {\"tool_names\": [...]}", param="tools")


def _needs_approval(policy: Any, name: str) -> bool:
    """OpenAI's require_approval: "always" (the default), "never", or {"always"/"never": {"tool_names"}}."""
    if policy is None or policy == "always":
        return True
    if policy == "never":
        return False
    if isinstance(policy, dict):
        never = _names(policy.get("never")) or set()
        always = _names(policy.get("always")) or set()
        if name in always:
            return True
        return name not in never
    raise UsageError(f"require_approval {policy!r} is not one of always, never or a tool filter", param="tools")


def mcp_tools(raw: list[Any] | None, servers: ToolServers | None, listed: set[str]) -> McpTools | None:
    """The request's mcp tools (None when it has none); starts the servers it names. `listed`:
    the labels an earlier response of the conversation already listed (not listed again)."""
    wanted = [t for t in raw or () if isinstance(t, dict) and t.get("type") == "mcp"]
    if not wanted:
        return None
    if servers is None or not servers.specs:
        raise UsageError("this server has no MCP servers for mcp tools",
                         "start it with 'localrun serve --mcp FILE' naming them", param="tools")
    out = McpTools(servers)
    for spec in wanted:
        label = spec.get("server_label")
        if not isinstance(label, str) or label not in servers.specs:
            raise UsageError(f"the mcp tool's server_label {label!r} is not one of this server's MCP servers",
                             f"use one of: {', '.join(sorted(servers.specs)) or 'none'}", param="tools")
        url = spec.get("server_url")
        if url is not None and url != servers.specs[label].url:
            raise UsageError(f"server_url {url!r} is not the URL of the MCP server '{label}' this server lists",
                             "leave server_url out: the server's owner decides where its MCP servers are",
                             param="tools")
        if spec.get("connector_id"):
            raise UsageError("connectors are not served here", "name an MCP server by server_label", param="tools")
        allowed = _names(spec.get("allowed_tools"))
        found = [t for t in servers.tools([label]) if t.server == label]
        if label in servers.failures:
            out.listings.append({"type": "mcp_list_tools", "server_label": label, "tools": [],
                                 "error": f"the MCP server '{label}' is not available: {servers.failures[label]}"})
            continue
        tools = [t for t in found if allowed is None or t.name in allowed]
        for t in tools:
            seen = t.name if t.name not in out.tools else f"{label}__{t.name}"
            out.tools[seen] = ServerTool(t.server, t.name, t.description, t.schema, t.title, seen)
            out.approval[seen] = _needs_approval(spec.get("require_approval"), t.name)
        if label not in listed:
            out.listings.append({"type": "mcp_list_tools", "server_label": label, "tools": [
                {"name": t.name, "description": t.description, "input_schema": t.schema, "annotations": None}
                for t in tools]})
    return out


def error_of(result: CallResult) -> dict[str, Any] | None:
    """An mcp_call's error field for a failed call (the tool's own error, or the call's)."""
    if not result.is_error:
        return None
    return {"type": "mcp_tool_execution_error", "content": [{"type": "text", "text": result.text}]}
