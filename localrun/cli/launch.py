"""`localrun launch AGENT [MODEL]`: a coding agent (Codex, Claude Code, OpenCode) on a local model."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import Any

from localrun.cli.serve import DEFAULT_HOST, DEFAULT_PORT


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", help="run a coding agent (codex, claude, opencode) on a local model",
                       description=cmd_launch.__doc__)
    p.add_argument("agent", choices=("codex", "claude", "opencode"), help="the agent to run")
    p.add_argument("model", help="the model it works with (see 'localrun list')")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"the server's address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"the server's port (default {DEFAULT_PORT}); one already running there is used")
    p.add_argument("--ctx", type=int, metavar="N",
                   help="context of the server it starts (default: enough for the agent's prompts, within the "
                        "model's and memory's limits)")
    p.add_argument("--small", metavar="MODEL",
                   help="claude, opencode: the model for small requests (titles, summaries; Claude's haiku tier), "
                        "default MODEL")
    p.add_argument("--config", action="store_true",
                   help="print the agent's configuration for this model and server instead of running it")
    p.set_defaults(func=cmd_launch, takes_rest=True)
    p.epilog = "Arguments after -- go to the agent, e.g. localrun launch codex qwen3:8b -- exec \"fix the test\""


def cmd_launch(args: argparse.Namespace) -> int:
    """Run a coding agent on a local model: use the localrun server on --host/--port, or start one
    with a context large enough for the agent's prompts (and stop it after), point the agent at
    it (Codex: a provider and a model catalog entry with the model's real context, passed with
    -c so your own config.toml is left alone; Claude Code: its environment; OpenCode: a provider in
    OPENCODE_CONFIG_CONTENT, over your own configuration) and run the agent with the arguments
    after --.
    --config prints the configuration instead, for users who keep their own."""
    from localrun import agents, api
    from localrun.settings import LoadOptions
    from localrun.store import home

    agent = agents.AGENTS[args.agent]
    target = api.resolve_target(args.model)
    model = target.model
    name = target.name
    choice = api.default_context(model, LoadOptions())
    trained = choice.trained or choice.tokens
    ctx, warning = agents.context_for(agent, trained, choice.tokens) if args.ctx is None else (args.ctx, None)
    if args.ctx is not None and args.ctx < agent.prompt_tokens:
        warning = f"--ctx {args.ctx} cannot hold {agent.name}'s first request (about {agent.prompt_tokens} tokens)"
    if warning:
        print(f"localrun: warning: {warning}", file=sys.stderr)
    url = f"http://{args.host}:{args.port}"
    key_env = "LOCALRUN_API_KEY" if os.environ.get("LOCALRUN_API_KEY") else None
    caps = api.capabilities(model)
    binary = agents.find(agent)
    if agent.name == "codex":
        agent_args, text = agents.codex_setup(binary, url, name, ctx, "thinking" in caps, "vision" in caps,
                                              home() / "agents", key_env)
        env = dict(os.environ)
    elif agent.name == "opencode":
        small = api.resolve_target(args.small).name if args.small else None
        config = agents.opencode_config(url, name, ctx, small, key_env)
        text = json.dumps(config, indent=2) + "\n"
        env = {**os.environ, "OPENCODE_CONFIG_CONTENT": json.dumps(config)}
        agent_args = []
    else:
        small = api.resolve_target(args.small).name if args.small else None
        env = {**os.environ, **agents.claude_env(url, name, small, os.environ.get("LOCALRUN_API_KEY"))}
        env.pop("ANTHROPIC_API_KEY", None)  # a key for Anthropic's servers would be sent to this one
        agent_args, text = [], "".join(f"export {k}={shlex.quote(v)}\n"
                                       for k, v in agents.claude_env(url, name, small).items())
    if args.config:
        print(text, end="")
        return 0
    rest = list(getattr(args, "rest", []))
    # Claude Code and OpenCode run title requests (and sub-agents) beside their turns: two sequences
    # (fewer if memory holds one only), so those neither wait for the turn nor take its KV cache
    parallel = 1 if agent.name == "codex" else 2
    server = None if _running(url) else _start_server(args.host, args.port, ctx, parallel)
    try:
        return subprocess.call([binary, *agent_args, *rest], env=env)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


def _running(url: str) -> bool:
    """Whether a localrun server answers at url."""
    import httpx

    try:
        return "localrun" in httpx.get(f"{url}/api/version", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False


def _start_server(host: str, port: int, ctx: int, parallel: int) -> Any:
    """`localrun serve` in the background, its log in the data folder, once it answers."""
    import time

    from localrun.errors import LocalrunError
    from localrun.store import home

    log = home() / "logs" / "launch-serve.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    what = f"a {ctx}-token context" + (f" for each of {parallel} sequences" if parallel > 1 else "")
    print(f"localrun: starting a server on {host}:{port} with {what} (log: {log})", file=sys.stderr)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "localrun", "serve", "--host", host, "--port", str(port),
                                 "--ctx", str(ctx), "--parallel", str(parallel)], stdout=out, stderr=out)
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if _running(url):
            return proc
        time.sleep(0.2)
    proc.kill()
    last = (log.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    raise LocalrunError(f"the server did not start: {last}", f"see {log}")
