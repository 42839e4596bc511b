"""Coding-agent traffic replayed against `localrun serve` and llama.cpp's llama-server on the same
model file, context, sequences and threads, measured in the same run.

    python benchmarks/bench_agents.py [--model NAME] [--template FILE] [--ctx 16384] [--parallel 2]
        [--rounds 3] [--tokens 16] [--threads N] [--shapes codex,codex-fn,claude] [--json FILE]

The model is the starter (SmolLM2-135M-Instruct) with a chat template that declares tools
(Qwen2.5's, from llama.cpp's models/templates, written into a copy of the file with gguf's
gguf_new_metadata's copy): with the starter's own template, which has no tool syntax,
llama-server leaves the agents' tools out of the prompt (the model never sees them), so the two
servers would not evaluate the same prompt. --template none keeps the file's own template. The
agents' prompts are longer than the starter's trained 8192 tokens, and llama-server caps a
sequence at the trained context: the copy declares --ctx as its trained context, for both
servers (the work a prompt costs is the same; the replies past 8192 tokens are not the point).

The traffic starts from the agents' own first requests: the real Codex CLI and Claude Code
(installed by `make agents`) are pointed once at a recording endpoint, and the request each sends
first (its instructions, tools and options, as `localrun launch` configures it) is what the
replay builds on. Every request is streamed, greedy (temperature 0), with --tokens output tokens
at most, and identical for both servers: the replay appends fixed tool calls and tool results,
never a server's own output.

codex (POST /v1/responses, as Codex sends it: the whole input every turn, store false): the first
request, then 5 turns that each add a function call and its output (~300 tokens). llama-server
drops the tools that are not functions (apply_patch, a freeform tool; the multi-agent namespace),
so its prompt is shorter by theirs; codex-fn sends the same loop with the function tools only, the
prompt both servers render alike.

claude (POST /v1/messages?beta=true, with Claude Code's first line carrying a nonce, cch=, that
changes on every request): the main conversation's 6 turns, each after the first adding a
tool_use and its tool_result, and between them:
  (b) a title request (a short system prompt of its own) after turn 1,
  (a) two sub-agents at once after turn 3 (a system prompt and tools of their own, shared by the
      two); with --parallel 2 they take both sequences, so
  (d) turn 4 finds the main conversation evicted from the KV cache (a server keeps it in host
      memory or evaluates it again),
  (c) after turn 5 a branch: the user rewinds to turn 3 and asks otherwise; turn 6 then continues
      the original line.

Per request: prompt tokens, tokens evaluated (the prompt less what the server reports as read
from its cache: `input_tokens_details.cached_tokens`; `cache_read_input_tokens`), time to first
output (request sent -> first delta of text, arguments or thought). Per round: the wall time of
each shape's whole session. Each round runs each shape on each server in turn (the order of the
servers alternates): a server started for the shape, the model loaded by a warm-up request, the
replay, the server stopped (no shape finds another's cache). Reported: medians over
rounds, and the ratio localrun / llama-server of the session times.

Targets: codex (and codex-fn) <= 0.8x llama-server's time, claude <= 0.5x; every turn after the first evaluates
only its new tokens (the tables show what each server evaluated).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from bench_serve import Config, Server  # noqa: E402

from tests.agents import record_requests  # noqa: E402  (the same recorder as the tests')

SERVERS = ("localrun", "llama-server")
TARGETS = {"codex": 0.8, "codex-fn": 0.8, "claude": 0.5}
TASK = "The tests in tests/test_parser.py fail since the last change to parser.py. Find out why and fix it."
# Claude Code's twelve most used tools (its first request then holds about 12.7k tokens)
CLAUDE_TOOLS = "Agent,Bash,Edit,Read,Write,NotebookEdit,WebFetch,WebSearch,TaskCreate,TaskList,TaskUpdate,Skill"
SUBAGENT_SYSTEM = (
    "You are an agent for Claude Code. Given the user's message, use the tools available to complete the task. "
    "Do what has been asked; nothing more, nothing less. When you complete the task, respond with a detailed "
    "writeup. Notes: search for code, configurations and patterns across large codebases; analyze multiple files "
    "to understand system architecture; investigate complex questions that require exploring many files; "
    "perform multi-step research tasks. Be thorough: check multiple locations, consider different naming "
    "conventions, look for related files. Never create files unless absolutely necessary. In your final "
    "response, share file paths (always absolute) relevant to the task and any code snippets that matter.")
TITLE_SYSTEM = ("Summarize this coding conversation in under 50 characters. Capture the main task, key files, "
                "problems addressed and current status. Answer with the title only.")


# ---- the model ----------------------------------------------------------------------------------

def tools_model(model: str, template: str, ctx: int) -> str:
    """The model's file with another chat template and a trained context of at least ctx (llama-server
    caps a sequence at the trained context), registered in the store (written once)."""
    import gguf
    from gguf.scripts import gguf_new_metadata as meta
    from llama_tools import cache_root, llama_cpp_version, source_dir

    from localrun import api

    info = api.get_model(model)
    reader = gguf.GGUFReader(info.path)
    arch = meta.get_field_data(reader, gguf.Keys.General.ARCHITECTURE)
    key = gguf.Keys.LLM.CONTEXT_LENGTH.format(arch=arch)
    new = {}
    if (meta.get_field_data(reader, key) or 0) < ctx:
        new[key] = meta.MetadataDetails(gguf.GGUFValueType.UINT32, ctx)
    suffix = f"ctx{ctx}"
    if template != "none":
        path = Path(template)
        if not path.is_file():
            path = source_dir(cache_root(), llama_cpp_version()) / "models" / "templates" / template
        new[gguf.Keys.Tokenizer.CHAT_TEMPLATE] = meta.MetadataDetails(gguf.GGUFValueType.STRING, path.read_text())
        suffix += f"-{path.stem}"
    if not new:
        return model
    out = cache_root() / "models" / f"{Path(info.path).stem}-{suffix}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
        meta.copy_with_new_metadata(reader, writer, new, [])
        tmp.rename(out)
    name = f"{model.split(':')[0]}-agents:{model.split(':')[-1]}"
    api.add_model(str(out), name, replace=True)
    return name


# ---- the agents' first requests --------------------------------------------------------------

def _agent(name: str) -> str:
    from localrun import agents

    local = HERE.parent / ".agents" / "node_modules" / ".bin" / agents.AGENTS[name].command
    if local.exists():
        os.environ.setdefault(f"LOCALRUN_{name.upper()}", str(local))
    try:
        return agents.find(agents.AGENTS[name])
    except Exception as e:  # noqa: BLE001
        raise SystemExit(f"{name} is needed for its traffic: {e} (or run 'make agents')") from e


@functools.cache
def codex_request(model: str, ctx: int) -> dict[str, Any]:
    from localrun import agents

    codex = _agent("codex")

    def run(url: str, folder: Path) -> None:
        args, _ = agents.codex_setup(codex, url, model, ctx, False, False, folder / "catalog")
        (folder / "work").mkdir()
        (folder / "home").mkdir()
        subprocess.run([codex, *args, "exec", "--skip-git-repo-check", "--ephemeral", TASK], cwd=folder / "work",
                       env={**os.environ, "CODEX_HOME": str(folder / "home"), "NO_COLOR": "1"},
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)

    bodies = [b for path, b in record_requests(run) if path.endswith("/responses")]
    if not bodies:
        raise SystemExit("Codex sent no request to the recording endpoint")
    return bodies[0]


@functools.cache
def claude_request(model: str) -> dict[str, Any]:
    from localrun import agents

    claude = _agent("claude")

    def run(url: str, folder: Path) -> None:
        (folder / "work").mkdir()
        env = {"HOME": str(folder / "home"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NO_COLOR": "1",
               **agents.claude_env(url, model)}
        subprocess.run([claude, "-p", TASK, "--tools", CLAUDE_TOOLS], cwd=folder / "work", env=env,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=300)

    bodies = [b for path, b in record_requests(run) if "/messages" in path and b.get("tools")]
    if not bodies:
        raise SystemExit("Claude Code sent no request with its tools to the recording endpoint")
    return bodies[0]


# ---- the replays -----------------------------------------------------------------------------

def tool_output(k: int) -> str:
    """A tool's result: some 300 tokens of a source file, different for each k."""
    lines = [f"{i:4d}  def parse_{k}_{i}(text: str) -> list[str]:  # splits field {i} of record kind {k}"
             for i in range(1, 14)]
    return f"parser.py (part {k}):\n" + "\n".join(lines)


class Nonce:
    """Claude Code's first system line, with a cch= nonce that changes on every request (the same
    sequence for every server)."""

    def __init__(self, line: str) -> None:
        self.head = line.split(" cch=")[0].rstrip(";").rstrip() + ";"
        self.head = self.head.replace("cc_entrypoint=sdk-cli", "cc_entrypoint=cli")
        self.rng = random.Random(7)

    def __call__(self) -> str:
        return f"{self.head} cch={self.rng.getrandbits(20):05x};"


def _with_nonce(system: list[dict[str, Any]], nonce: Nonce) -> list[dict[str, Any]]:
    out = copy.deepcopy(system)
    out[0]["text"] = nonce()
    return out


def codex_requests(first: dict[str, Any], model: str, tokens: int,
                   functions_only: bool = False) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, [request]) steps of the Codex loop: its first request, then 5 turns with tool results.
    functions_only: only its function tools (those llama-server renders; it drops the others)."""
    base = {**first, "model": model, "stream": True, "store": False, "max_output_tokens": tokens, "temperature": 0}
    if functions_only:
        base["tools"] = [t for t in first["tools"] if t.get("type") == "function"]
    tool = next(t["name"] for t in first["tools"] if t.get("type") == "function")
    items = list(first["input"])
    steps = [("turn 1", [dict(base, input=list(items))])]
    for k in range(1, 6):
        items += [{"type": "function_call", "call_id": f"call_{k}", "name": tool,
                   "arguments": json.dumps({"cmd": f"sed -n '{k * 40},{k * 40 + 40}p' parser.py"})},
                  {"type": "function_call_output", "call_id": f"call_{k}", "output": tool_output(k)}]
        steps.append((f"turn {k + 1}", [dict(base, input=list(items))]))
    return steps


def claude_requests(first: dict[str, Any], model: str, tokens: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """(label, [requests sent at once]) steps of the Claude Code session (see the module's text)."""
    nonce = Nonce(first["system"][0]["text"])
    base = {k: v for k, v in first.items() if k not in ("thinking", "context_management", "output_config")}
    base.update(model=model, stream=True, max_tokens=tokens, temperature=0)
    system = first["system"]
    messages = copy.deepcopy(first["messages"])
    for block in messages[0]["content"]:  # the user's task
        if block.get("type") == "text" and not block["text"].startswith("<system-reminder>"):
            block["text"] = TASK

    def main(msgs: list[dict[str, Any]]) -> dict[str, Any]:
        return dict(base, system=_with_nonce(system, nonce), messages=copy.deepcopy(msgs))

    def turn(msgs: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
        use = {"type": "tool_use", "id": f"toolu_{k:02d}", "name": "Read",
               "input": {"file_path": "/work/parser.py", "offset": k * 40, "limit": 40}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{k:02d}", "content": tool_output(k)}
        return [*msgs, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]

    steps: list[tuple[str, list[dict[str, Any]]]] = [("turn 1", [main(messages)])]
    steps.append(("(b) title", [dict(base, system=[{"type": "text", "text": nonce()},
                                                   {"type": "text", "text": TITLE_SYSTEM}],
                                     tools=[], messages=[{"role": "user", "content": TASK}])]))
    m2 = turn(messages, 2)
    steps.append(("turn 2", [main(m2)]))
    m3 = turn(m2, 3)
    steps.append(("turn 3", [main(m3)]))
    sub_tools = [t for t in first["tools"] if t.get("name") not in ("Agent", "Edit", "Write", "NotebookEdit")]
    subs = [dict(base, system=[{"type": "text", "text": nonce()}, {"type": "text", "text": SUBAGENT_SYSTEM}],
                 tools=sub_tools, messages=[{"role": "user", "content": q}])
            for q in ("Find every caller of parse_record in this repository.",
                      "List the tests that exercise parser.py and what each checks.")]
    steps.append(("(a) 2 sub-agents", subs))
    m4 = turn(m3, 4)
    steps.append(("(d) turn 4", [main(m4)]))
    m5 = turn(m4, 5)
    steps.append(("turn 5", [main(m5)]))
    branch = [*copy.deepcopy(m3), {"role": "assistant", "content": "The bug is in parse_record."},
              {"role": "user", "content": "Instead of fixing it, add a failing test that shows it."}]
    steps.append(("(c) branch at 3", [main(branch)]))
    steps.append(("(c) turn 6", [main(turn(m5, 6))]))
    return steps


# ---- measuring -------------------------------------------------------------------------------

DELTAS = {"response.output_text.delta", "response.function_call_arguments.delta", "response.reasoning_text.delta",
          "response.custom_tool_call_input.delta", "content_block_delta"}


def send(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: prompt tokens, tokens read from the cache, time to first output, wall."""
    import httpx

    t0 = time.perf_counter()
    first = None
    prompt = cached = output = None
    with httpx.Client(timeout=1800) as client, client.stream("POST", url + path, json=body,
                                                             headers={"x-api-key": "local"}) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}{path} answered {r.status_code}: {r.read()[:800]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            ev = json.loads(data)
            kind = ev.get("type")
            if first is None and kind in DELTAS:
                first = time.perf_counter() - t0
            if kind in ("response.completed", "response.incomplete"):
                u = ev["response"]["usage"]
                prompt, cached, output = u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]
            elif kind == "message_start":
                u = ev["message"]["usage"]
                cached = u.get("cache_read_input_tokens") or 0
                prompt = u["input_tokens"] + cached + (u.get("cache_creation_input_tokens") or 0)
            elif kind == "message_delta":
                output = ev.get("usage", {}).get("output_tokens")
            elif kind in ("error", "response.failed"):
                raise SystemExit(f"{url}{path}: {data[:800]}")
    wall = time.perf_counter() - t0
    if prompt is None:
        raise SystemExit(f"{url}{path}: the stream reported no usage")
    return {"prompt": prompt, "cached": cached, "evaluated": prompt - (cached or 0), "output": output,
            "ttft": first if first is not None else wall, "wall": wall}


def replay(url: str, path: str, steps: list[tuple[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    rows = []
    t0 = time.perf_counter()
    for label, bodies in steps:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            results = list(pool.map(lambda b: send(url, path, b), bodies))
        rows.append({"step": label, "requests": results})
    return {"wall": time.perf_counter() - t0, "steps": rows}


def round_of(name: str, cfg: Config, shapes: dict[str, tuple[str, list[Any]]]) -> dict[str, Any]:
    """Each shape on a server of its own (no cache left by another shape), after a warm-up request
    that loads the model."""
    out = {}
    for shape, (path, steps) in shapes.items():
        with Server(name, cfg) as server:
            send(server.url, "/v1/messages", {"model": cfg.model, "max_tokens": 4, "stream": True, "temperature": 0,
                                              "messages": [{"role": "user", "content": "Say hi."}]})
            out[shape] = replay(server.url, path, steps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--template", default="Qwen-Qwen2.5-7B-Instruct.jinja",
                    help="a chat template with tool syntax for the model (a file, or one of llama.cpp's "
                         "models/templates; 'none': the model's own)")
    ap.add_argument("--ctx", type=int, default=16384, help="tokens per sequence (the agents' prompts need >8192)")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--shapes", default="codex,codex-fn,claude")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    from localrun import api

    args.model = tools_model(args.model, args.template, args.ctx)
    info = api.get_model(args.model)
    cfg = Config(model=args.model, path=str(info.path), tokens=args.tokens, clients=[1], requests_per_client=1,
                 ctx=args.ctx, threads=args.threads, flash_attn="auto", gpu_layers=None, parallel=args.parallel,
                 ready_timeout=600)
    wanted = args.shapes.split(",")
    shapes: dict[str, tuple[str, list[Any]]] = {}
    if "codex" in wanted:
        shapes["codex"] = ("/v1/responses", codex_requests(codex_request(args.model, args.ctx), args.model, args.tokens))
    if "codex-fn" in wanted:
        shapes["codex-fn"] = ("/v1/responses", codex_requests(codex_request(args.model, args.ctx), args.model,
                                                              args.tokens, functions_only=True))
    if "claude" in wanted:
        shapes["claude"] = ("/v1/messages?beta=true", claude_requests(claude_request(args.model), args.model,
                                                                      args.tokens))
    servers = args.servers.split(",")
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        got = {}
        for name in order:
            got[name] = round_of(name, cfg, shapes)
            print(f"round {r + 1}: {name} " + ", ".join(f"{s} {got[name][s]['wall']:.1f} s" for s in shapes),
                  flush=True)
        rounds.append(got)
    report(rounds, servers, shapes, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rounds": rounds}, indent=1))
    return 0


def report(rounds: list[dict[str, Any]], servers: list[str], shapes: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nmodel {args.model}, ctx {args.ctx} x {args.parallel} sequences, {args.threads} threads, "
          f"{args.tokens} output tokens at most, {len(rounds)} rounds (medians)")
    for shape in shapes:
        print(f"\n{shape}: prompt tokens / evaluated / time to first output (s)")
        print(f"{'step':<20}{'prompt':>8}" + "".join(f"{s + ' eval':>20}{'ttft':>8}" for s in servers))
        steps = rounds[0][servers[0]][shape]["steps"]
        for i, step in enumerate(steps):
            for j, req in enumerate(step["requests"]):
                label = step["step"] + (f" #{j + 1}" if len(step["requests"]) > 1 else "")
                line = f"{label:<20}{req['prompt']:>8}"
                for s in servers:
                    cells = [rd[s][shape]["steps"][i]["requests"][j] for rd in rounds]
                    ev = statistics.median(c["evaluated"] for c in cells)
                    tt = statistics.median(c["ttft"] for c in cells)
                    line += f"{ev:>20.0f}{tt:>8.2f}"
                print(line)
        walls = {s: statistics.median(rd[s][shape]["wall"] for rd in rounds) for s in servers}
        total = {s: sum(req["evaluated"] for st in rounds[-1][s][shape]["steps"] for req in st["requests"])
                 for s in servers}
        print("session wall (s): " + ", ".join(f"{s} {walls[s]:.1f}" for s in servers)
              + "; tokens evaluated: " + ", ".join(f"{s} {total[s]}" for s in servers))
        if "localrun" in walls and "llama-server" in walls:
            ratios = [rd["localrun"][shape]["wall"] / rd["llama-server"][shape]["wall"] for rd in rounds]
            ratio = statistics.median(ratios)
            ok = "met" if ratio <= TARGETS[shape] else "NOT met"
            print(f"localrun / llama-server: {ratio:.2f}x (median of per-round ratios; target <= "
                  f"{TARGETS[shape]}x: {ok})")


if __name__ == "__main__":
    sys.exit(main())
