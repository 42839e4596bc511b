"""Flags shared by run, batch and tui: generation settings and engine loading."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from localrun import settings
from localrun.settings import LoadOptions, Setting

if TYPE_CHECKING:
    from rich.progress import Progress

    from localrun.adapters import Target
    from localrun.constraint import Constraint
    from localrun.store import ModelInfo
    from localrun.tool_servers import ToolServers
    from localrun.tools import ToolPlan

MAX_PARALLEL = 256  # sequences decoded at once by one model


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
        if n < low or (high is not None and n > high):
            raise argparse.ArgumentTypeError(f"expected {low} to {high}, got {n}" if high is not None
                                             else f"expected a number >= {low}, got {n}")
        return n

    return parse


def cpu_moe_layers(value: str) -> int | str:
    """--cpu-moe's value: a number of layers, or 'all'."""
    if value == "all":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or a number of layers, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected 'all' or a number >= 0, got {value!r}")
    return n


def stderr_bar(label: str, extra: str) -> Progress | None:
    """A started rich progress bar on a terminal's stderr (label, bar, done/total, `extra` as a
    text column, time left), or None when stderr is not a terminal (callers print lines then)."""
    import sys

    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn(extra), TimeRemainingColumn(),
                   console=Console(stderr=True), transient=True)
    bar.start()
    return bar


def _flag_type(s: Setting) -> Callable[[str], Any]:
    """An argparse type that reads a flag's text by the table (settings.Setting.parse)."""
    from localrun.errors import UsageError

    def parse(text: str) -> Any:
        try:
            return s.parse(text, s.flag, "cli")
        except UsageError as e:
            raise argparse.ArgumentTypeError(f"{e.hint or e.message}, got {text!r}") from None

    return parse


def _default_note(s: Setting) -> str:
    if s.default in (None, (), False) or s.kind in ("drafter",):
        return ""
    shown = {True: "on", None: "auto"}.get(s.default, s.default) if s.kind == "switch" else s.default
    return f" (default {shown})"


def add_setting_flags(g: argparse._ActionsContainer, group: str, table: dict[str, Setting] | None = None) -> None:
    """The flags of one group of settings, as settings.py declares them (name, type, check, help)."""
    for s in (table if table is not None else settings.GENERATION).values():
        flags = s.names.get("cli")
        if not flags or s.group != group:
            continue
        # a load flag keeps the name argparse gives it (args.ctx); a generation one takes its field's
        kwargs: dict[str, Any] = {"help": s.help + _default_note(s)}
        if s.scope == "generation":
            kwargs["dest"] = s.name
        if s.kind == "bool":
            kwargs.update(action="store_true", default=None)
        elif s.kind in ("stops", "bias"):
            kwargs.update(action="append", default=[], type=_flag_type(s))
        elif s.choices:
            kwargs.update(choices=s.choices, default=s.default if s.kind != "switch" else "auto")
            if s.kind == "switch":
                kwargs["type"] = str.lower
        else:
            kwargs.update(type=_flag_type(s), default=s.default if s.scope == "load" else None)
        if s.metavar:
            kwargs["metavar"] = s.metavar
        g.add_argument(*flags, **kwargs)


def add_generation_flags(p: argparse.ArgumentParser, system: bool = True) -> None:
    """Sampling and stopping flags (from settings.py's table; unset flags leave a preset's, the model's
    and localrun's defaults)."""
    g = p.add_argument_group("generation")
    add_setting_flags(g, "generation")
    if system:
        g.add_argument("--system", help="system prompt")
    add_draft_flags(p)


def add_draft_flags(p: argparse.ArgumentParser) -> None:
    """Speculative decoding: how drafts are made and how long they may be."""
    add_setting_flags(p.add_argument_group("speculative decoding"), "speculative decoding")


def add_thinking_flags(p: argparse.ArgumentParser, hide: bool = True) -> None:
    """A thinking model's switch, effort and budget (and, for `run`, hiding its thought)."""
    g = p.add_argument_group("thinking models")
    g.add_argument("--think", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the model's thinking on or off (default: as its chat template does)")
    g.add_argument("--think-effort", choices=("low", "medium", "high"),
                   help="how hard the model thinks, where its template takes an effort (gpt-oss)")
    add_setting_flags(g, "thinking")
    if hide:
        g.add_argument("--hide-thinking", action="store_true", help="do not print the thought on stderr")


def think_from_args(args: argparse.Namespace) -> bool | str | None:
    """The request's think: an effort, on, off, or None (the template's default)."""
    from localrun.errors import UsageError

    effort, think = getattr(args, "think_effort", None), getattr(args, "think", None)
    if effort is not None and think is False:
        raise UsageError("--think-effort and --no-think cannot be combined", "give one of them")
    return effort if effort is not None else think


def check_think(model: ModelInfo, engine: str, think: bool | str | None) -> bool:
    """Whether the model thinks on this engine; thinking asked of one that cannot is refused, as
    serve's 400 does."""
    from localrun import api
    from localrun.errors import UsageError

    thinks = "thinking" in api.capabilities(model, engine)
    if think not in (None, False) and not thinks:
        raise UsageError(f"model '{model.name}' does not support thinking (its chat template has no reasoning format)",
                         "drop --think/--think-effort, or use a model that thinks")
    return thinks


def add_constraint_flags(p: argparse.ArgumentParser, format_flag: bool = True) -> None:
    """Structured output: the reply must match a JSON schema, any JSON object, a grammar or a choice."""
    g = p.add_argument_group("structured output (one of)")
    g.add_argument("--schema", metavar="FILE|JSON", help="the reply is JSON that validates against this JSON schema")
    if format_flag:
        g.add_argument("--format", choices=("json",), help="json: the reply is a JSON object")
    g.add_argument("--grammar", metavar="FILE", help="the reply matches this GBNF grammar (llama.cpp's format)")
    g.add_argument("--choice", metavar="A,B,C", help="the reply is exactly one of these comma-separated options")


def constraint_from_args(args: argparse.Namespace) -> Constraint | None:
    """The Constraint the flags ask for, or None."""
    from localrun.constraint import Constraint, read_text_or_file
    from localrun.errors import UsageError

    fmt = getattr(args, "format", None)
    given = {"--schema": args.schema, "--format": fmt if fmt == "json" else None, "--grammar": args.grammar,
             "--choice": args.choice}
    given = {k: v for k, v in given.items() if v is not None}
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} cannot be combined", "give one constraint")
    if args.schema is not None:
        return Constraint.schema(args.schema, "--schema")
    if args.grammar is not None:
        return Constraint.gbnf(read_text_or_file(args.grammar, "--grammar"), "--grammar")
    if args.choice is not None:
        return Constraint.choice([c.strip() for c in args.choice.split(",")], "--choice")
    if fmt == "json":
        return Constraint.json_object()
    return None


def add_tool_flags(p: argparse.ArgumentParser) -> None:
    """Tool calling: the tools (OpenAI's JSON shape) and whether the model must call one."""
    g = p.add_argument_group("tools")
    g.add_argument("--tools", metavar="FILE",
                   help='a JSON file with a list of tools ([{"type": "function", "function": {"name", "description", "parameters"}}])')
    g.add_argument("--tool-choice", default=None, metavar="auto|required|none|NAME",
                   help="auto (default): the model decides; required: it must call a tool; NAME: it must call that one")


def add_mcp_flags(p: argparse.ArgumentParser) -> None:
    """MCP servers whose tools the model may use, and which calls may run without asking."""
    g = p.add_argument_group("MCP tools")
    g.add_argument("--mcp", metavar="FILE",
                   help="an mcp.json naming MCP servers whose tools the model may use (default: mcp.json in "
                        "localrun's folder, when there is one)")
    g.add_argument("--no-mcp", action="store_true", help="use no MCP servers, even those of localrun's mcp.json")
    g.add_argument("--allow-tools", default="", metavar="NAME,...|all",
                   help="tools whose calls run without asking (a tool's name, SERVER/NAME, a server's name, or "
                        "all); other calls are asked about on a terminal and refused elsewhere")
    g.add_argument("--max-tool-steps", type=int_in(1), default=8, metavar="N",
                   help="replies with tool calls before the model must answer (default 8)")


def mcp_servers_from_args(args: argparse.Namespace) -> ToolServers | None:
    """The MCP servers --mcp (or localrun's own mcp.json) names, not started; None when there are
    none or with --no-mcp."""
    from localrun import api
    from localrun.errors import UsageError

    if getattr(args, "no_mcp", False):
        if args.mcp:
            raise UsageError("--mcp and --no-mcp say opposite things", "keep one")
        return None
    servers = api.mcp_servers(getattr(args, "mcp", None))
    return servers if servers.specs else None


def tool_plan_from_args(args: argparse.Namespace, model: ModelInfo) -> ToolPlan | None:
    """The ToolPlan for --tools on this model, or None."""
    import json

    from localrun import api
    from localrun.constraint import read_text_or_file
    from localrun.errors import UsageError
    from localrun.tools import ToolPlan

    if args.tools is None:
        return None  # --tool-choice alone is for MCP tools: the command checks it has some
    try:
        tools = json.loads(read_text_or_file(args.tools, "--tools"))
    except ValueError as e:
        raise UsageError(f"--tools: not JSON ({e})", "give a JSON list of tools, or the path of a file with one") from e
    return ToolPlan.make(api.chat_template(model), tools, tool_choice_arg(args.tool_choice))


def tool_choice_arg(value: str | None) -> Any:
    """--tool-choice as the APIs take it: auto, required or none, or a function's NAME."""
    from localrun import api

    return api.tool_choice(value)


def add_load_flags(p: argparse.ArgumentParser) -> None:
    """Engine loading flags (from settings.py's table); the engines come from the registry (which
    engine can do what: 'localrun doctor')."""
    from localrun.backends.base import backend_names

    g = p.add_argument_group("engine")
    add_setting_flags(g, "engine", settings.LOAD)
    g.add_argument("--engine", choices=backend_names(), help="force an engine")
    g.add_argument("--mmproj", metavar="FILE",
                   help="a vision model's projector (mmproj GGUF), when the store does not record one with it")
    g.add_argument("--lora", action="append", default=[], metavar="ADAPTER[:SCALE]",
                   help="apply a LoRA adapter (a name from 'localrun list', a GGUF adapter file, or a PEFT folder "
                        "for an engine that applies adapters when it loads) at this scale (default 1); repeatable")


def add_kv_type_flag(g: argparse._ActionsContainer) -> None:
    """--kv-type alone (eval takes it without the other engine flags)."""
    add_setting_flags(g, "engine", {"kv_type": settings.LOAD["kv_type"]})


def target_from_args(args: argparse.Namespace, engine: str | None = None) -> tuple[Target, str]:
    """The model and adapters that --lora and the model name (maybe an adapter, or base+adapter) ask for,
    and the engine that runs them."""
    from localrun import api

    target = api.resolve_target(args.model, getattr(args, "lora", None) or ())
    chosen = api.choose_engine(target.model, engine if engine is not None else getattr(args, "engine", None))
    if chosen != getattr(args, "engine", None):  # load_options_from_args checked the engine --engine forces
        _check_cpu_moe(args, chosen)
    return target, chosen


def _check_cpu_moe(args: argparse.Namespace, engine: str | None) -> None:
    """--cpu-moe needs an engine that can keep expert weights in host memory (abilities.expert_offload)."""
    from localrun.backends.base import abilities, backend_class, engines_with
    from localrun.errors import UsageError

    if getattr(args, "cpu_moe", 0) and engine is not None and not abilities(engine).expert_offload:
        able = engines_with("expert_offload")
        copies = [f"{' or '.join(backend_class(n).formats).upper()} copy of the model on {n}" for n in able]
        raise UsageError(f"--cpu-moe works only with the {' or '.join(able) or 'no'} engine, and {engine} cannot "
                         "place expert weights apart", f"drop --cpu-moe{', or run a ' + copies[0] if copies else ''}")


def load_options_from_args(args: argparse.Namespace, n_parallel: int = 1) -> LoadOptions:
    """LoadOptions from parsed flags."""
    fa = {"auto": None, "on": True, "off": False}[getattr(args, "flash_attn", "auto")]
    _check_cpu_moe(args, getattr(args, "engine", None))
    return LoadOptions(n_ctx=args.ctx, n_threads=args.threads, gpu_layers=args.gpu_layers, flash_attn=fa,
                       n_parallel=n_parallel, cpu_moe=getattr(args, "cpu_moe", 0),
                       kv_type=getattr(args, "kv_type", "f16"), draft=draft_model_path(getattr(args, "speculative", None)),
                       mmproj=_mmproj(getattr(args, "mmproj", None)))


def _mmproj(value: str | None) -> str | None:
    import os

    from localrun.errors import UsageError

    if value is None:
        return None
    if not os.path.isfile(value):
        raise UsageError(f"--mmproj {value}: no such file", "give the path of a projector (mmproj) GGUF file")
    return os.path.abspath(value)


def draft_model_path(value: str | None) -> str | None:
    """The GGUF file of --draft MODEL (None for --draft lookup or no --draft)."""
    if value is None or value == "lookup":
        return None
    from localrun import api

    return api.draft_file(value)
