"""`localrun batch`: many prompts through one model at once, resumable."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, cast

from localrun.cli.options import (
    MAX_PARALLEL,
    add_constraint_flags,
    add_generation_flags,
    add_load_flags,
    add_mcp_flags,
    add_thinking_flags,
    add_tool_flags,
    check_think,
    constraint_from_args,
    int_in,
    load_options_from_args,
    target_from_args,
    think_from_args,
    tool_choice_arg,
    tool_plan_from_args,
)

if TYPE_CHECKING:
    from localrun.batch import Progress, Record
    from localrun.cluster import Summary
    from localrun.tools import ToolPlan

DEFAULT_PARALLEL = 16


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("batch", help="run many prompts at once (JSONL or text in, JSONL or CSV out)",
                       description=cmd_batch.__doc__)
    p.add_argument("model", help="model name (see 'localrun list') or path to a .gguf file")
    p.add_argument("--input", "-i", required=True, metavar="IN",
                   help="JSONL ({\"id\", \"prompt\" | \"messages\", settings...} per line) or text (one prompt per line); '-' is stdin")
    p.add_argument("--output", "-o", required=True, metavar="OUT", help="where results go, one row each as it finishes; '-' is stdout")
    p.add_argument("--format", choices=("jsonl", "csv", "json"),
                   help="jsonl or csv: the output format (default: csv for a .csv file, else jsonl); "
                        "json: every reply is a JSON object (structured output)")
    p.add_argument("--output-format", choices=("jsonl", "csv"), help="the output format, when --format says json")
    p.add_argument("--resume", action="store_true", help="skip the ids already in OUT and append the others")
    p.add_argument("--parallel", "-p", type=int_in(1, MAX_PARALLEL), default=DEFAULT_PARALLEL, metavar="N",
                   help=f"rows generated at once (default {DEFAULT_PARALLEL})")
    p.add_argument("--raw", action="store_true", help="complete prompts as plain text, without the chat template")
    add_generation_flags(p)
    add_thinking_flags(p, hide=False)
    add_constraint_flags(p, format_flag=False)
    add_tool_flags(p)
    add_mcp_flags(p)
    add_load_flags(p)
    r = p.add_argument_group("on a Ray cluster (pip install 'localrun[ray]')")
    r.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="spread the rows over a pool of Ray actors, each with the model loaded: ADDRESS is 'auto' (the "
                        "running cluster), HOST:PORT or ray://HOST:10001; without it a local cluster is started")
    r.add_argument("--ray-actors", type=int_in(1), metavar="N",
                   help="actors (default: one per GPU with --ray-gpus-per-actor, else one per node)")
    r.add_argument("--ray-cpus-per-actor", type=float, metavar="N", help="CPUs each actor takes (its engine threads)")
    r.add_argument("--ray-gpus-per-actor", type=float, default=0.0, metavar="N", help="GPUs each actor takes (default 0)")
    r.add_argument("--ray-retries", type=int_in(0), default=2, metavar="N",
                   help="times a block whose actor died is tried again on another actor (default 2)")
    r.add_argument("--model-path", metavar="PATH",
                   help="the model file at this path on every node (shared storage) instead of each node's own copy")
    p.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    """Generate a reply for every row of IN with MODEL, running up to N rows at once, and write
    each to OUT as it finishes. Rows keep their ids (text input: line numbers); a bad row gets
    {"id", "error"} and the others go on. Ctrl-C stops with every finished row written; --resume
    continues. Exit status 1 if any row failed."""
    import dataclasses

    from localrun import api, settings
    from localrun import batch as batching
    from localrun.errors import UsageError

    if args.ray is not None:
        api.require_ray()  # the install hint before any work
    elif args.model_path or args.ray_actors or args.ray_cpus_per_actor or args.ray_gpus_per_actor:
        raise UsageError("--ray-actors, --ray-cpus-per-actor, --ray-gpus-per-actor and --model-path need --ray")
    options = load_options_from_args(args, n_parallel=args.parallel)
    target, engine = target_from_args(args)
    model = target.model
    if args.mcp and args.no_mcp:
        raise UsageError("--mcp and --no-mcp say opposite things", "keep one")
    if args.mcp:  # batch uses MCP servers only when named: a script's runs do not change with a config
        if args.tools is not None or args.raw or args.ray is not None:
            raise UsageError("--mcp runs the rows' tool calls here, on chat rows",
                             "drop --tools, --raw and --ray, or drop --mcp")
        if not args.allow_tools.strip():
            raise UsageError("batch runs no tool unasked: name the tools its rows may call",
                             "add --allow-tools NAME,... (a tool, SERVER/NAME, a server) or --allow-tools all")
    elif args.tool_choice is not None and args.tools is None:
        raise UsageError("--tool-choice needs --tools or --mcp")
    plan = None if args.mcp else tool_plan_from_args(args, model)
    settle = batching.settle(settings.from_args(args), target, engine, constraint_from_args(args), plan)
    params = settle({}, None)
    options = target.load_options(options, engine)
    think = think_from_args(args)
    thinks = check_think(model, engine, think)
    fmt = batching.output_format(args.output, args.output_format or (args.format if args.format != "json" else None))
    batching.check_output(args.output, args.resume)
    rows = batching.read_input(args.input, settle, args.system, args.raw, think)
    total = len(rows)
    if args.resume:
        done = batching.finished_ids(args.output, fmt)
        rows = [r for r in rows if batching.key(r.id) not in done]
    skipped = total - len(rows)
    report = _Report(len(rows), skipped)
    if not rows:
        report.summary()
        return 0
    if not thinks:
        rows = batching.refuse_thinking(rows, model.name)
    if plan is not None:
        rows = batching.with_tools(rows, plan)
    if target.preset is not None:  # the preset's system prompt, starting conversation and template
        rows = [dataclasses.replace(r, request=target.request(r.request)) if r.request is not None else r for r in rows]
    if args.ctx is None:  # just what the rows can use (the model's own context at most)
        limit = api.default_context(model, options).tokens
        # rows with MCP tools grow by the tools' descriptions and results: the model's context
        n_ctx = limit if args.mcp else batching.sequence_length(rows, params, limit)
        options = dataclasses.replace(options, n_ctx=n_ctx)
    cancel = threading.Event()
    summary: Summary | None = None
    servers: Any = None
    if args.ray is not None:
        summary = api.cluster_summary()
        records = api.batch_on_cluster(
            model, rows, params, options, engine, address=args.ray or None, actors=args.ray_actors,
            cpus_per_actor=args.ray_cpus_per_actor, gpus_per_actor=args.ray_gpus_per_actor, retries=args.ray_retries,
            model_path=args.model_path, cancel=cancel, progress=report.progress, summary=summary,
            notice=lambda line: print(f"localrun batch: {line}", file=sys.stderr, flush=True))
        session = None
    elif args.mcp:
        session = api.load(model, options, engine=engine)
        servers = api.mcp_servers(args.mcp)
        loop = api.tool_loop(servers, args.allow_tools.split(","), max_steps=args.max_tool_steps)
        for server, why in servers.failures.items():
            print(f"localrun batch: MCP server '{server}' is not available: {why}; going on without its tools",
                  file=sys.stderr, flush=True)

        def plan_for(choice: str) -> ToolPlan:
            from localrun.tools import ToolPlan as Plan

            step = Plan.make(api.chat_template(model), loop.functions(), tool_choice_arg(choice))
            assert step is not None
            return step

        if not loop.tools:
            print("localrun batch: no MCP tools are available; the rows are answered without them", file=sys.stderr)
        records = batching.run_rows_with_tools(session, rows, params, loop, plan_for,
                                               (args.tool_choice or "auto") if loop.tools else "none",
                                               cancel=cancel, progress=report.progress)
    else:
        session = api.load(model, options, engine=engine)
        records = api.batch(session, rows, params, cancel=cancel, progress=report.progress)
    writer = batching.Writer(args.output, fmt, append=args.resume)
    previous = _on_ctrl_c(cancel)
    try:
        for record in records:
            if plan is not None and "text" in record:
                record = cast("batching.Record", plan.record(dict(record)))
            writer.write(record)
            report.row(record)
    finally:
        signal.signal(signal.SIGINT, previous)
        records.close()
        writer.close()
        report.close()
        if session is not None:
            session.close()
        if servers is not None:
            servers.close()
    if summary is not None:
        for a in summary.actors:
            state = f", died: {a['error']}" if a["error"] else ""
            print(f"localrun batch: actor {a['actor']} (pid {a['pid']} on {a['node']}): {a['rows']} rows, "
                  f"{a['tokens']} tokens, {a['tokens_per_second']:.1f} tok/s{state}", file=sys.stderr)
    report.summary(cancelled=cancel.is_set())
    if cancel.is_set():
        return 130
    return 1 if report.failed else 0


def _on_ctrl_c(cancel: threading.Event) -> Any:
    """First Ctrl-C stops the batch cleanly (finished rows stay written); a second one aborts."""

    def handler(signum: int, frame: Any) -> None:
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        print("\nlocalrun: stopping; finished rows are written (Ctrl-C again to abort)", file=sys.stderr)

    return signal.signal(signal.SIGINT, handler)


class _Report:
    """Progress on stderr (a bar on a terminal, a line now and then otherwise) and the summary."""

    def __init__(self, total: int, skipped: int) -> None:
        self.total, self.skipped = total, skipped
        self.ok = self.failed = self.prompt_tokens = self.completion_tokens = 0
        self.t0 = time.perf_counter()
        self.last: Progress | None = None
        self.printed = 0.0
        self.bar: Any = None
        self.task: Any = None
        if sys.stderr.isatty() and total:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(TextColumn("rows"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[speed]}"), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("rows", total=total, speed="")
            self.bar.start()

    def row(self, record: Record) -> None:
        if "error" in record:
            self.failed += 1
        else:
            self.ok += 1
            self.prompt_tokens += record.get("prompt_tokens", 0)
            self.completion_tokens += record.get("completion_tokens", 0)

    def progress(self, p: Progress) -> None:
        self.last = p
        speed = f"{p.tokens_per_second:.1f} tok/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=p.rows_done, speed=speed)
            return
        now = time.perf_counter()
        if p.rows_done and (now - self.printed >= 1.0 or p.rows_done == p.rows_total):
            self.printed = now
            print(f"localrun batch: {p.rows_done}/{p.rows_total} rows, {p.completion_tokens} tokens, {speed}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def summary(self, cancelled: bool = False) -> None:
        wall = time.perf_counter() - self.t0
        rate = self.completion_tokens / wall if wall > 0 else 0.0
        parts = [f"{self.ok} ok", f"{self.failed} failed"]
        if self.skipped:
            parts.append(f"{self.skipped} already done")
        left = self.total - self.ok - self.failed
        if cancelled and left:
            parts.append(f"{left} not run (--resume continues)")
        print(f"localrun batch: {self.total + self.skipped} rows ({', '.join(parts)}); "
              f"{self.prompt_tokens} prompt + {self.completion_tokens} generated tokens; "
              f"{rate:.1f} tok/s; {wall:.1f} s", file=sys.stderr, flush=True)
