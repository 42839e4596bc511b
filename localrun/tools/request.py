"""What a request says about tools: the tools list and tool_choice, checked and normalized."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from localrun.constraint import check_schema, enforceable
from localrun.errors import UsageError

CHOICES = ("auto", "required", "none")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """Validate an OpenAI (or Ollama) tools list into [{"type": "function", "function": {...}}]."""
    if raw is None:
        return []
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise UsageError('tools must be a list of {"type": "function", "function": {"name": ...}} objects')
    out = [_tool(i, t) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in out]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"tools: the function name '{name}' is used twice", "give each tool its own name")
    return out


def _tool(i: int, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise UsageError(f'tools[{i}] must be an object {{"type": "function", "function": {{...}}}}')
    if raw.get("type", "function") != "function":
        raise UsageError(f"tools[{i}] has type {raw.get('type')!r}", "only 'function' tools are supported")
    fn = raw.get("function")
    if not isinstance(fn, Mapping):
        raise UsageError(f"tools[{i}] needs a 'function' object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(f"tools[{i}]: function name {name!r} is invalid",
                         "use 1 to 64 letters, digits, '_', '-' or '.'")
    out: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise UsageError(f"tool '{name}': 'description' must be a string")
    if desc is not None:
        out["description"] = desc
    params = fn.get("parameters")
    if params is not None:
        out["parameters"] = _parameters(name, params)
    return {"type": "function", "function": out}


def _parameters(name: str, params: Any) -> dict[str, Any]:
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise UsageError(f"tool '{name}': 'parameters' must be a JSON schema of type object",
                         'for example {"type": "object", "properties": {"city": {"type": "string"}}}')
    try:
        params = json.loads(json.dumps(params))
    except (TypeError, ValueError) as e:
        raise UsageError(f"tool '{name}': 'parameters' is not JSON ({e})") from e
    params = enforceable(params)  # what a tool declares beyond that, the tool checks itself
    check_schema(params, f"parameters of tool '{name}'")
    return params


def normalize_choice(raw: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """tool_choice as "auto", "required", "none" or the name of the function it forces."""
    names = [t["function"]["name"] for t in tools]
    if raw is None:
        return "auto"
    if isinstance(raw, Mapping):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else raw.get("name")  # Responses API: flat
        if raw.get("type", "function") != "function" or not isinstance(name, str):
            raise UsageError(f"invalid tool_choice {raw!r}", 'use {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise UsageError(f"tool_choice names the function '{name}', which is not in tools",
                             f"tools: {', '.join(names) or 'none given'}")
        return name
    if raw not in CHOICES:
        raise UsageError(f"invalid tool_choice {raw!r}",
                         'use "auto", "required", "none" or {"type": "function", "function": {"name": ...}}')
    if raw == "required" and not names:
        raise UsageError("tool_choice 'required' needs at least one tool")
    return str(raw)

