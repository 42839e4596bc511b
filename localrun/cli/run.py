"""`localrun run`: one reply, or an interactive chat in the terminal."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.cli.options import (
    add_constraint_flags,
    add_generation_flags,
    add_load_flags,
    add_mcp_flags,
    add_thinking_flags,
    add_tool_flags,
    check_think,
    constraint_from_args,
    load_options_from_args,
    mcp_servers_from_args,
    target_from_args,
    think_from_args,
    tool_choice_arg,
    tool_plan_from_args,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from localrun.backends.base import Session
    from localrun.generation import Chunk, Request
    from localrun.settings import GenerationParams
    from localrun.store import ModelInfo
    from localrun.tool_loop import Answer, Outcome, Reply, ToolLoop, ToolUse
    from localrun.tool_servers import ServerTool, ToolServers
    from localrun.tools import ToolPlan

    # One exchange of a chat: (text, system prompt, history, attached images, cancel) -> the
    # reply's last chunk and the messages it adds after the user's (tool calls and results, then
    # the answer)
    Exchange = Callable[[str, str | None, list[dict[str, Any]], list[bytes], Any],
                        tuple[Chunk | None, list[dict[str, Any]]]]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="chat with a model, or answer one prompt", description=cmd_run.__doc__)
    p.add_argument("model", help="model name (see 'localrun list') or path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="the prompt; '-' reads it from stdin; omit for an interactive chat")
    p.add_argument("--raw", action="store_true", help="complete the prompt as plain text, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and statistics")
    p.add_argument("--verbose", "-v", action="store_true", help="print token counts and speed on stderr")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for a vision model, shown before the prompt (repeatable; '-' reads it from stdin)")
    add_generation_flags(p)
    add_constraint_flags(p)
    add_thinking_flags(p)
    add_tool_flags(p)
    add_mcp_flags(p)
    add_load_flags(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    """Answer PROMPT with MODEL and exit (only the reply goes to stdout), or chat interactively
    when no prompt is given. '-' (or a pipe) reads the prompt from stdin."""
    from localrun import api

    with api.engine_started_early(args.model, args.engine):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from localrun import api, settings
    from localrun.errors import UsageError
    from localrun.generation import Request
    from localrun.images import read_file as read_image

    given = settings.from_args(args)
    constraint = constraint_from_args(args)
    options = load_options_from_args(args)
    think = think_from_args(args)
    prompt = args.prompt
    if args.image.count("-") > 1 or ("-" in args.image and prompt == "-"):
        raise UsageError("standard input can carry one thing: the prompt or one image")
    if args.image and args.raw:
        raise UsageError("--image needs the chat template", "drop --raw")
    images = [read_image(path) for path in args.image]
    if prompt == "-" or (prompt is None and not sys.stdin.isatty() and "-" not in args.image):
        prompt = sys.stdin.read()
    if prompt is not None and not prompt.strip():
        raise UsageError("the prompt is empty", "pass a prompt, or '-' to read it from stdin")
    if prompt is None and args.json:
        raise UsageError("--json needs a prompt", "pass a prompt, or '-' to read it from stdin")
    if args.tools is not None and not (args.json and prompt is not None and not args.raw):
        raise UsageError("--tools needs --json and a chat prompt", "the reply's tool calls come back in the JSON")
    target, engine = target_from_args(args)
    model = target.model
    plan = tool_plan_from_args(args, model)
    servers = mcp_servers_from_args(args)
    if servers and (args.raw or args.tools is not None):
        if args.mcp:
            raise UsageError("MCP tools need the chat template and localrun running the calls",
                             "drop --raw and --tools, or drop --mcp")
        servers = None  # localrun's own mcp.json: not for raw prompts or caller-run tools
    if args.tool_choice is not None and args.tools is None and servers is None:
        raise UsageError("--tool-choice needs --tools or MCP servers (--mcp)")
    _check_think(model, engine, think)
    params = settings.resolve(given, target, engine, constraint=constraint, tools=plan)
    name = target.preset_name or model.name
    session = api.load(model, target.load_options(options, engine), engine=engine)
    warning = session.info().get("warning")
    if warning:
        print(f"localrun: warning: '{name}': {warning}", file=sys.stderr)
    if params.speculative and (off := session.info().get("no_drafts")):
        print(f"localrun: note: '{name}': {off}", file=sys.stderr)
    if args.verbose:
        i = session.info()
        gpu = f"{i['offloaded']} layers on GPU" if i.get("offloaded") else "CPU"
        print(f"[{i.get('engine')}: {gpu}, {i.get('n_threads')} threads, context {i.get('n_ctx')}]", file=sys.stderr)
    tools = _Tools(args, servers) if servers else None

    def prepare(msgs: list[dict[str, Any]], choice: str, functions: list[dict[str, Any]]) -> tuple[Request, GenerationParams, ToolPlan]:
        """A tool step's request and settings: the tools held to this step's choice."""
        return api.tool_step(target, engine, msgs, functions, tool_choice_arg(choice), given, think=think,
                             constraint=constraint)

    try:
        if tools is not None:
            return _with_tools(session, name, args, tools, prepare, prompt, images)
        if prompt is None:
            return _interactive(name, args, images, _plain_exchange(session, args, params, think, target.request))
        request = Request.raw(prompt, args.system) if args.raw else api.build_messages(prompt, args.system,
                                                                                        images=images)
        if plan is not None:
            request = plan.request(request.messages)
        if not args.raw:
            request = target.request(dataclasses.replace(request, think=think))
        return _answer(session, name, request, params, args, plan)
    finally:
        if tools is not None:
            tools.close()
        session.close()


def _setter(event: Any) -> Any:
    """A signal handler that sets event."""

    def handler(signum: int, frame: Any) -> None:
        event.set()

    return handler


def _check_think(model: ModelInfo, engine: str, think: bool | str | None) -> None:
    """Thinking asked of a model that cannot think is refused, as serve's 400 does; thinking off on
    a template that always thinks (gpt-oss) is said once, and its thought still kept apart."""
    from localrun import api

    if think is None:
        return
    check_think(model, engine, think)
    fmt = api.reasoning_format(model) if think is False else None
    if fmt is not None and not fmt.can_switch_off:
        print(f"localrun: {model.name} always thinks (its chat template cannot switch thinking off); "
              "its thought is kept apart from the answer", file=sys.stderr)


def _answer(session: Session, name: str, request: Request, params: GenerationParams, args: argparse.Namespace,
            plan: ToolPlan | None = None) -> int:
    from localrun import api

    parts: list[str] = []
    thought = _Thought(args)
    last = None
    out = sys.stdout
    for chunk in api.stream(session, request, params):
        if chunk.done:
            last = chunk
            break
        thought.feed(chunk.thinking, chunk.text)
        parts.append(chunk.text)
        if not args.json:
            out.write(chunk.text)
            out.flush()
    assert last is not None
    thought.end()
    text = "".join(parts)
    if args.json:
        record = {"model": name, "text": text, **_stats(last)}
        if thought.parts or last.thinking_tokens:
            record["thinking"] = "".join(thought.parts)
            record["thinking_tokens"] = last.thinking_tokens
        if plan is not None:
            record = plan.record(record)
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if args.verbose:
        _print_stats(last)
    return 130 if last.finish_reason == "cancelled" else 0


class _Thought:
    """A thinking model's thought on stderr (dimmed on a terminal) as it streams, unless hidden or
    the reply goes out as JSON; kept for --json."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.show = not (getattr(args, "hide_thinking", False) or getattr(args, "json", False))
        self.dim = sys.stderr.isatty()
        self.parts: list[str] = []
        self.open = False

    def feed(self, thinking: str, answer: str) -> None:
        if thinking:
            self.parts.append(thinking)
            if self.show:
                sys.stderr.write(f"\x1b[2m{thinking}\x1b[0m" if self.dim else thinking)
                sys.stderr.flush()
                self.open = True
        if answer:
            self.end()

    def end(self) -> None:
        """The thought is over: its block on stderr ends with a line break."""
        if self.open:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.open = False


def _stats(chunk: Chunk) -> dict[str, Any]:
    return {
        "finish_reason": chunk.finish_reason,
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "tokens_per_second": round(chunk.tokens_per_second, 2),
        "prompt_ms": round(chunk.prompt_ms, 2),
        "decode_ms": round(chunk.decode_ms, 2),
        "seed": chunk.seed,
        **({"drafted_tokens": chunk.drafted_tokens, "accepted_tokens": chunk.accepted_tokens}
           if chunk.drafted_tokens else {}),
        **({"images_encoded": chunk.images_encoded} if chunk.images_encoded else {}),
    }


def _print_stats(chunk: Chunk) -> None:
    print(
        f"[{chunk.prompt_tokens} prompt tokens in {chunk.prompt_ms:.0f} ms, {chunk.completion_tokens} tokens at"
        f" {chunk.tokens_per_second:.1f} tok/s, {chunk.finish_reason}"
        + (f", {chunk.images_encoded} image{'s' if chunk.images_encoded > 1 else ''} encoded" if chunk.images_encoded else "")
        + "]",
        file=sys.stderr,
    )


def _typed() -> str | None:
    """A line typed at the chat's prompt, stripped: None for Ctrl-D (leave), "" for Ctrl-C."""
    try:
        return input(">>> ").strip()
    except EOFError:
        print(file=sys.stderr)
        return None
    except KeyboardInterrupt:
        print("^C (Ctrl-D leaves)", file=sys.stderr)
        return ""


def _interactive(name: str, args: argparse.Namespace, images: list[bytes], exchange: Exchange,
                 tools: _Tools | None = None) -> int:
    """A multi-turn chat: Ctrl-C stops the current reply, Ctrl-D (or /bye) leaves. Each reply's
    thought is kept apart from its answer in the history, for templates that read earlier thoughts;
    with MCP tools, the calls and results of a reply stay in the history before its answer."""
    import threading

    from localrun.errors import ContextOverflowError

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:
        pass
    from localrun import images as imagefiles
    from localrun.errors import UsageError

    system = args.system
    history: list[dict[str, Any]] = []
    pending = list(images)  # images for the next message (--image, /image PATH)
    err = sys.stderr
    print(f"Chatting with {name}{', with tools' if tools else ''}. Ctrl-C stops a reply, Ctrl-D leaves. "
          "/help for commands.", file=err)
    while True:
        text = _typed()
        if text is None:
            return 0
        if not text:
            continue
        pasted = imagefiles.pasted_image(text)  # a line that is one image file's path (dropped or pasted) attaches it
        if pasted is not None:
            text = f"/image {pasted}"
        if text.startswith("/"):
            cmd, _, rest = text.partition(" ")
            if cmd in ("/bye", "/exit", "/quit"):
                return 0
            if cmd == "/clear":
                history.clear()
                print("(conversation cleared)", file=err)
            elif cmd == "/system":
                system = rest or None
                print(f"(system prompt {'set' if system else 'cleared'})", file=err)
            elif cmd == "/image":
                path = imagefiles.unquoted(rest)
                try:
                    data = imagefiles.read_file(path)
                except UsageError as e:
                    print(f"localrun: {e}", file=err)
                    continue
                pending.append(data)
                print(f"[image {Path(path).name}: {imagefiles.describe(data)}] attached to your next message",
                      file=err)
            elif cmd == "/tools" and tools is not None:
                tools.list()
            else:
                print("/clear forgets the conversation, /system TEXT sets the system prompt, /image PATH (or the "
                      "path alone, pasted or dropped) attaches an image to your next message, "
                      + ("/tools lists the MCP tools, " if tools else "") + "/bye leaves", file=err)
            continue
        cancel = threading.Event()
        # Ctrl-C while a reply streams sets `cancel` instead of raising: an exception can land
        # anywhere (even where Python drops it, as in a finalizer), a flag is read within 50 ms
        main = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
        previous = signal.signal(signal.SIGINT, _setter(cancel)) if main else None
        try:
            last, added = exchange(text, system, history, pending, cancel)
        except ContextOverflowError as e:
            print(f"localrun: {e}; use /clear to start over", file=err)
            continue
        except UsageError as e:  # this message's fault (an image the model cannot read): the chat goes on
            print(f"localrun: {e}", file=err)
            pending.clear()
            continue
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            print("(stopped; this exchange was not kept)", file=err)
            continue
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        sys.stdout.write("\n")
        if cancel.is_set() or (last is not None and last.finish_reason == "cancelled"):
            print("(stopped; this exchange was not kept)", file=err)
            continue
        history += [{"role": "user", "content": text, **({"images": pending} if pending else {})}, *added]
        pending = []
        if args.verbose and last is not None:
            _print_stats(last)


def _plain_exchange(session: Session, args: argparse.Namespace, params: GenerationParams, think: bool | str | None,
                    prepare: Callable[[Request], Request]) -> Exchange:
    """A chat's exchange without tools: the reply streamed to stdout, its thought to stderr."""
    import dataclasses

    from localrun import api

    def exchange(text: str, system: str | None, history: list[dict[str, Any]], images: list[bytes],
                 cancel: Any) -> tuple[Chunk | None, list[dict[str, Any]]]:
        request = dataclasses.replace(prepare(api.build_messages(text, system, history, images)), think=think)
        parts: list[str] = []
        thought = _Thought(args)
        last = None
        stream = api.stream(session, request, params, cancel)
        try:
            for chunk in stream:
                if chunk.done:
                    last = chunk
                    break
                thought.feed(chunk.thinking, chunk.text)
                parts.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        finally:
            stream.close()  # a Ctrl-C that raised: cancels the reply in the engine and waits for it to stop
        thought.end()
        # The thought stays apart: the engine gives it to the template under its format's field, or drops it.
        reply = {"role": "assistant", "content": "".join(parts)}
        if thought.parts:
            reply["thinking"] = "".join(thought.parts)
        return last, [reply]

    return exchange


class _Tools:
    """MCP tools in a terminal: the servers start on the first message and stop with the chat;
    each call is shown on stderr as it runs and, unless --allow-tools allows it, asked about when
    stdin and stderr are a terminal (refused otherwise, saying how to allow it)."""

    def __init__(self, args: argparse.Namespace, servers: ToolServers) -> None:
        self.args = args
        self.servers = servers
        self.asks = sys.stdin.isatty() and sys.stderr.isatty()
        self.allowed = args.allow_tools.split(",")
        self.loop: ToolLoop | None = None
        self.dim = sys.stderr.isatty()

    def start(self) -> ToolLoop:
        from localrun import api

        if self.loop is None:
            self.loop = api.tool_loop(self.servers, self.allowed, self._ask if self.asks else None,
                                      max_steps=self.args.max_tool_steps, on_use=self._shown)
            for server, why in self.servers.failures.items():
                spec = self.servers.specs.get(server)
                log = f" (its messages: {self.servers.log_path(server)})" if spec is not None and spec.command else ""
                print(f"localrun: MCP server '{server}' is not available: {why}{log}; going on without its tools",
                      file=sys.stderr)
        return self.loop

    def _ask(self, tool: ServerTool, arguments: dict[str, Any]) -> Answer:
        args = json.dumps(arguments, ensure_ascii=False)
        while True:
            try:
                answer = input(f"allow {tool.server}/{tool.name} {args}? [y]es once, [a]lways, [n]o, ne[v]er: ")
            except EOFError:
                return "no"
            choice = {"y": "once", "yes": "once", "a": "always", "always": "always", "n": "no", "no": "no",
                      "v": "never", "never": "never"}.get(answer.strip().lower())
            if choice is not None:
                return choice  # type: ignore[return-value]

    def _shown(self, use: ToolUse) -> None:
        from localrun.tool_loop import describe

        line = f"[tool {describe(use)}]"
        if use.refused and not self.asks:
            line += f" (not run: allow it with --allow-tools {use.tool})"
        if not self.args.json:
            print(f"\x1b[2m{line}\x1b[0m" if self.dim else line, file=sys.stderr)

    def list(self) -> None:
        """The tools the model is offered, and the servers that are not available (/tools)."""
        loop = self.start()
        for t in loop.tools.values():
            print(f"{t.server}/{t.name}: {t.description.splitlines()[0] if t.description else ''}", file=sys.stderr)
        for server, why in self.servers.failures.items():
            print(f"{server}: not available ({why})", file=sys.stderr)

    def close(self) -> None:
        self.servers.close()


def _tool_reply(session: Session, request: Request, params: GenerationParams, plan: ToolPlan, show: bool,
                thought: _Thought, cancel: Any = None) -> Reply:
    """Stream one reply of a tool step: its content to stdout as it comes (when shown), its calls
    parsed from the whole text."""
    from localrun import api

    streamer = plan.streamer()
    parts: list[str] = []
    last = None
    for chunk in api.stream(session, request, params, cancel):
        if chunk.done:
            last = chunk
            break
        thought.feed(chunk.thinking, chunk.text)
        parts.append(chunk.text)
        if show:
            _show_content(streamer.feed(chunk.text) if streamer else [("content", chunk.text)])
    if show and streamer is not None:
        _show_content(streamer.flush())
    thought.end()
    return api.tool_reply(plan, "".join(parts), last, "".join(thought.parts))


def _show_content(events: list[Any]) -> None:
    """The content part of a reply's events on stdout (its calls are shown when they run)."""
    for e in events:
        if e[0] == "content" and isinstance(e[1], str) and e[1]:
            sys.stdout.write(e[1])
    sys.stdout.flush()


def _with_tools(session: Session, name: str, args: argparse.Namespace, tools: _Tools,
                prepare: Callable[..., tuple[Request, GenerationParams, ToolPlan]], prompt: str | None,
                images: list[bytes]) -> int:
    """One reply (or a chat) whose model may call the MCP servers' tools until it answers."""

    def messages(text: str, system: str | None, history: list[dict[str, Any]],
                 attached: list[bytes]) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": system}] if system else []
        return [*head, *history, {"role": "user", "content": text, **({"images": attached} if attached else {})}]

    def run_turn(msgs: list[dict[str, Any]], show: bool, cancel: Any = None) -> tuple[Outcome, _Thought]:
        loop = tools.start()
        thought = _Thought(args)

        def generate(step_msgs: list[dict[str, Any]], step_choice: str) -> Reply:
            request, params, plan = prepare(step_msgs, step_choice, loop.functions())
            return _tool_reply(session, request, params, plan, show, thought, cancel)

        if not loop.tools:
            print("localrun: no MCP tools are available; the model answers without them", file=sys.stderr)
        return loop.run(generate, msgs, (args.tool_choice or "auto") if loop.tools else "none"), thought

    if prompt is None:
        def exchange(text: str, system: str | None, history: list[dict[str, Any]], attached: list[bytes],
                     cancel: Any) -> tuple[Chunk | None, list[dict[str, Any]]]:
            msgs = messages(text, system, history, attached)
            outcome, _ = run_turn(msgs, True, cancel)
            reply: dict[str, Any] = {"role": "assistant", "content": outcome.reply.text}
            if outcome.reply.thinking:
                reply["thinking"] = outcome.reply.thinking
            return outcome.reply.final, [*outcome.messages[len(msgs):], reply]

        return _interactive(name, args, images, exchange, tools)

    outcome, thought = run_turn(messages(prompt, args.system, [], images), not args.json)
    last = outcome.reply.final
    if args.json:
        record: dict[str, Any] = {"model": name, "text": outcome.reply.text, **_stats(last),
                                  "tool_uses": [u.to_dict() for u in outcome.uses]}
        if thought.parts:
            record["thinking"] = "".join(thought.parts)
        sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    elif not outcome.reply.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose:
        _print_stats(last)
    return 130 if last.finish_reason == "cancelled" else 0
