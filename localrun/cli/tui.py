"""`localrun tui` (and `localrun` alone): the terminal UI."""

from __future__ import annotations

import argparse
from typing import Any

from localrun.cli.options import (
    add_generation_flags,
    add_load_flags,
    add_mcp_flags,
    add_setting_flags,
    load_options_from_args,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tui", help="open the terminal UI (also: 'localrun' alone)", description=cmd_tui.__doc__)
    p.add_argument("model", nargs="?", help="open straight into a chat with this model")
    p.add_argument("--light", action="store_true", help="start with the light theme")
    add_generation_flags(p)
    add_setting_flags(p.add_argument_group("thinking models"), "thinking")
    add_mcp_flags(p)
    mcp = next(g for g in p._action_groups if g.title == "MCP tools")
    mcp.add_argument("--tool-choice", default=None, metavar="auto|required|none|NAME",
                     help="what the model does with the MCP tools in the first reply to each message: auto "
                          "(default: it decides), required (it calls a tool), none, or a tool's NAME (it calls "
                          "that one); a chat's tools panel (Ctrl+L) sets its own")
    add_load_flags(p)
    p.set_defaults(func=cmd_tui)


def cmd_tui(args: argparse.Namespace) -> int:
    """Open the terminal UI: Library, Discover, Chat and Convert. Generation flags become the
    defaults of new chats; MODEL opens straight into a chat with it. The chat may use the tools of
    the MCP servers of --mcp FILE (or of localrun's own mcp.json), each call asked about first."""
    app = app_from_args(args)
    try:
        app.run()
    finally:
        app.mcp.close()
        app.models.close()
    return int(app.return_code or 0)


def app_from_args(args: argparse.Namespace) -> Any:
    """The app with the command line's settings (flags are validated here, before the UI starts)."""
    from localrun import settings
    from localrun.errors import UsageError
    from tui.app import LocalrunApp

    lora = getattr(args, "lora", None) or []
    model = getattr(args, "model", None)
    if lora and not model:
        raise UsageError("--lora needs a MODEL to apply the adapters to", "e.g. localrun tui BASE --lora ADAPTER")
    if lora and model:
        from localrun import api

        model = api.resolve_target(model, lora).name  # checked now; the chat runs base+adapter
    given = settings.from_args(args)
    settings.resolve(given)  # values that fail only together (draft min over max) fail here, not in a chat
    mcp, no_mcp = getattr(args, "mcp", None), getattr(args, "no_mcp", False)
    if mcp and no_mcp:
        raise UsageError("--mcp and --no-mcp say opposite things", "keep one")
    return LocalrunApp(
        settings=given,
        load_options=load_options_from_args(args),
        engine=getattr(args, "engine", None),
        system=getattr(args, "system", None),
        model=model,
        theme="textual-light" if getattr(args, "light", False) else None,
        mcp=mcp,  # a file that is missing or wrong is refused here, before the UI starts
        use_mcp=not no_mcp,
        allowed_tools=(getattr(args, "allow_tools", "") or "").split(","),
        max_tool_steps=getattr(args, "max_tool_steps", 8),
        tool_choice=getattr(args, "tool_choice", None),
    )


def default(args: argparse.Namespace) -> int:
    """`localrun` with no command: the TUI with default settings."""
    from localrun.cli import build_parser

    return cmd_tui(build_parser().parse_args(["tui"]))
