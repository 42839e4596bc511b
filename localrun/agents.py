"""Coding agents pointed at a localrun server: what each needs to run on a local model (its
provider configuration, its model catalog, its environment), how large its prompts are, and
the context that holds them. `localrun launch` (cli/launch.py) runs them with it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.errors import UsageError

# A conversation's room beyond the agent's first request: tool results and replies of a session.
WORKING_ROOM = 8192
# The context localrun asks for, at least, when the model and memory hold it.
AGENT_CONTEXT = 32768


@dataclass(frozen=True)
class Agent:
    """A coding agent: its command, the npm package it comes from, and its first request's size."""

    name: str
    command: str
    package: str
    prompt_tokens: int  # its first request (instructions and tools), measured with its defaults

    @property
    def install_hint(self) -> str:
        return f"install it with 'npm install -g {self.package}' (Node.js 20 or newer)"


AGENTS = {
    "codex": Agent("codex", "codex", "@openai/codex", 9100),
    "claude": Agent("claude", "claude", "@anthropic-ai/claude-code", 12700),
    "opencode": Agent("opencode", "opencode", "opencode-ai", 7600),
}


def find(agent: Agent) -> str:
    """The agent's command on PATH ($LOCALRUN_<NAME> first), or a UsageError saying how to install it."""
    path = os.environ.get(f"LOCALRUN_{agent.name.upper()}") or shutil.which(agent.command)
    if not path:
        raise UsageError(f"{agent.name} is not installed", agent.install_hint)
    return path


def context_for(agent: Agent, trained: int, fits: int) -> tuple[int, str | None]:
    """The context to serve the agent with: its first request and room to work, at least
    AGENT_CONTEXT, within what the model was trained for and memory holds; and a warning when
    that cannot hold the agent's first request."""
    want = max(AGENT_CONTEXT, agent.prompt_tokens + WORKING_ROOM)
    ctx = min(want, trained, fits)
    if ctx < agent.prompt_tokens:
        why = "it was trained for" if trained <= fits else "memory holds"
        return ctx, (f"{agent.name}'s first request is about {agent.prompt_tokens} tokens and this model holds "
                     f"{ctx} ({why} no more): it will be refused as too long; use a model with a longer "
                     f"context, or narrow {agent.name}'s prompt with its own options")
    if ctx < agent.prompt_tokens + WORKING_ROOM:
        return ctx, (f"the context is {ctx} tokens and {agent.name}'s first request about {agent.prompt_tokens}: "
                     "little room is left for the session")
    return ctx, None


# -- Codex ---------------------------------------------------------------------------------------


def codex_models(codex: str) -> list[dict[str, Any]]:
    """The model catalog this Codex has built in (`codex debug models`), read with an empty
    CODEX_HOME so that no user setting changes it."""
    with tempfile.TemporaryDirectory(prefix="localrun-codex-") as home:
        try:
            out = subprocess.run([codex, "debug", "models"], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "CODEX_HOME": home}, check=True).stdout
            models = json.loads(out)["models"]
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as e:
            raise UsageError(f"could not read Codex's model catalog ('{codex} debug models': {e})",
                             "update Codex ('npm install -g @openai/codex')") from e
    if not models:
        raise UsageError("Codex's model catalog is empty", "update Codex ('npm install -g @openai/codex')")
    return list(models)


def codex_entry(template: dict[str, Any], slug: str, context: int, thinks: bool, vision: bool) -> dict[str, Any]:
    """A catalog entry for a local model, made from one of Codex's own (so it has every field this
    Codex version reads): its context, what it can do, and apply_patch as a freeform tool, which
    Codex declares only for models whose entry says so."""
    levels = [{"effort": e, "description": f"{e} reasoning effort"} for e in ("low", "medium", "high")]
    entry = {k: v for k, v in template.items() if k not in ("tool_mode", "multi_agent_version",
                                                              "multi_agent_reasoning_effort")}
    entry.update(
        slug=slug, display_name=slug, description="a local model served by localrun", upgrade=None,
        availability_nux=None, priority=0, visibility="list", supported_in_api=True,
        context_window=context, max_context_window=context, apply_patch_tool_type="freeform",
        supported_reasoning_levels=levels if thinks else [], default_reasoning_level="medium" if thinks else None,
        supports_reasoning_summaries=thinks, default_reasoning_summary="none",
        input_modalities=["text", "image"] if vision else ["text"], supports_search_tool=False,
        additional_speed_tiers=[], service_tiers=[], use_responses_lite=False, supports_reasoning_effort_updates=False,
        include_skills_usage_instructions=False, include_plugin_usage_instructions=False,
        include_apps_usage_instructions=False, experimental_supported_tools=[])
    return entry


def _template(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The entry of Codex's catalog to start from: one that calls tools directly (not in code mode)."""
    plain = [m for m in models if m.get("tool_mode") in (None, "default") and m.get("visibility") == "list"]
    return (plain or models)[-1]


def codex_setup(codex: str, url: str, slug: str, context: int, thinks: bool, vision: bool, folder: Path,
                api_key_env: str | None = None) -> tuple[list[str], str]:
    """Codex's command-line overrides (-c) that point it at localrun with this model, and the same
    as config.toml text; the catalog is written to `folder` (the user's own config is left alone)."""
    entry = codex_entry(_template(codex_models(codex)), slug, context, thinks, vision)
    folder.mkdir(parents=True, exist_ok=True)
    catalog = folder / f"codex-models-{_safe(slug)}.json"
    tmp = catalog.with_name(catalog.name + ".tmp")
    tmp.write_text(json.dumps({"models": [entry]}, indent=1))
    tmp.replace(catalog)
    provider = {"name": "localrun", "base_url": f"{url.rstrip('/')}/v1", "wire_api": "responses"}
    if api_key_env:
        provider["env_key"] = api_key_env
    values = {"model": slug, "model_provider": "localrun", "model_catalog_json": str(catalog)}
    args = [a for k, v in values.items() for a in ("-c", f"{k}={_toml(v)}")]
    args += ["-c", "model_providers.localrun={" + ", ".join(f"{k} = {_toml(v)}" for k, v in provider.items()) + "}"]
    text = "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
    text += "\n[model_providers.localrun]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in provider.items())
    return args, text


def _toml(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string for what is written here


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# -- Claude Code -----------------------------------------------------------------------------------


def claude_env(url: str, model: str, small: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """Claude Code's environment for a localrun server: the base URL, a token (the server's key, or
    any), the model for every tier and sub-agents (a small one for the haiku tier when given), no
    traffic to Anthropic beyond the requests, and a timeout a local model's long prompt fits."""
    return {
        "ANTHROPIC_BASE_URL": url.rstrip("/"),
        "ANTHROPIC_AUTH_TOKEN": api_key or "localrun",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": small or model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "3000000",
    }


# -- OpenCode --------------------------------------------------------------------------------------


def opencode_config(url: str, model: str, context: int, small: str | None = None,
                    api_key_env: str | None = None) -> dict[str, Any]:
    """OpenCode's configuration for a localrun server: a `localrun` provider (OpenAI-compatible, at
    the server's /v1) with the model's real context, the model for its work and for its titles
    (`small`, default the model). Given in OPENCODE_CONFIG_CONTENT, it goes over the user's own."""
    output = min(8192, max(256, context // 4))  # what OpenCode reserves for a reply
    models = {name: {"name": name, "limit": {"context": context, "output": output}, "tool_call": True}
              for name in dict.fromkeys([model, small or model])}
    options: dict[str, Any] = {"baseURL": f"{url.rstrip('/')}/v1"}
    options["apiKey"] = f"{{env:{api_key_env}}}" if api_key_env else "localrun"
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {"localrun": {"npm": "@ai-sdk/openai-compatible", "name": "localrun", "options": options,
                                      "models": models}},
            "model": f"localrun/{model}", "small_model": f"localrun/{small or model}"}
