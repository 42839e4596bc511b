"""Streaming chat through `localrun serve` against llama-cpp-python's own server and llama.cpp's
C++ llama-server, on the same model file, measured in the same run.

    python benchmarks/bench_serve.py [--model NAME] [--clients 1,16] [--rounds 3] [--tokens 64]
        [--servers localrun,llama-cpp-python,llama-server] [--requests-per-client 2] [--ctx 1024]
        [--threads N] [--flash-attn on|off] [--gpu-layers N] [--baseline REV] [--json FILE]

Each client is one async httpx client that POSTs /v1/chat/completions (stream, greedy, max_tokens
--tokens, its own user prompt) --requests-per-client times. Each round starts each server in turn
(the order reverses every other round), waits for /health (or /v1/models) to answer 200, sends a
warm-up request, measures every --clients level and stops the server, so only one server runs at a
time. With localrun among the servers a round also times `localrun run` in process (api.load +
session.stream, the same LoadOptions), the reference for the one-client decode speed.

Every server gets the same threads, per-sequence context (llama-server's -c is the total over its
-np slots), flash-attention setting, batch size 512 and --parallel = the largest --clients.
llama-cpp-python's server runs one request at a time; it gets --interrupt_requests false, since by
default it cuts concurrent streams short.

Measures, the median over rounds: aggregate tok/s (tokens delivered / wall time of the level),
time to first token p50/p95 (request sent -> first content chunk), per-stream decode tok/s
((content chunks - 1) / (last chunk - first chunk), as bench_run.py times `localrun run`), tokens
delivered. Every server's tokens are counted the same way, from the client's side: the content
each stream delivered, tokenized with the model's own vocabulary (a server's own usage figure is
kept in the JSON, never used to rank it).

Targets (medians of per-round ratios): at 16 clients localrun >= 1.8x llama-cpp-python's server
and >= 1.0x llama-server in aggregate tok/s; at 1 client localrun serve's decode >= 0.97x
`localrun run`'s.

--baseline REV adds `localrun@REV`: the same `localrun serve` from a git worktree of REV (its
package first on PYTHONPATH, the same venv), measured in the same rounds, so a change is timed
before and after on one machine at one time. Then the targets are: localrun >= 0.97x localrun@REV
in aggregate tok/s at every level, in decode at 1 client, and in time to first token at 1 client
(the ratio is REV's TTFT over ours). A stream's delivered text is its content and its
reasoning_content (a thinking model's thought), so a version that splits the thought off and one
that does not deliver the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_batch import SYSTEM, TOPICS  # noqa: E402  (same prompts as the batch benchmark)

SERVERS = ("localrun", "llama-cpp-python", "llama-server")
RUN = "localrun run"  # the in-process reference, not a server
TARGETS = (  # (label, clients, numerator, denominator, measure, target)
    ("localrun / llama-cpp-python server", 16, "localrun", "llama-cpp-python", "tok_s", 1.8),
    ("localrun / llama-server", 16, "localrun", "llama-server", "tok_s", 1.0),
    ("localrun serve / localrun run", 1, "localrun", RUN, "decode_tok_s", 0.97),
)


@dataclass
class Config:
    model: str
    path: str
    tokens: int
    clients: list[int]
    requests_per_client: int
    ctx: int
    threads: int
    flash_attn: str
    gpu_layers: int | None
    parallel: int
    ready_timeout: float
    temperature: float = 0.0  # 0: greedy; else sampled with a seed per request, the same on every server
    baseline_tree: str | None = None  # the worktree of --baseline's revision
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-serve-")))


@dataclass
class Result:
    """One level (server x clients) of one round."""

    server: str
    clients: int
    requests: int
    tokens: int  # delivered: the streams' content tokenized with the model's vocabulary, for every server
    chunks: int
    wall_s: float
    tok_s: float
    ttft_p50: float
    ttft_p95: float
    decode_tok_s: float  # per stream, median over requests
    usage_tokens: int | None  # what the server's usage said, where every stream reported it
    finish_reasons: dict[str, int]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


KINDS = ("story", "essay", "travel diary", "letter")
WARM_UP = -1


def messages(i: int) -> list[dict[str, str]]:
    """Request i's chat: the shared system prompt and a user prompt of its own (i < 128)."""
    if i == WARM_UP:  # the warm-up shares only the system prompt with the measured requests
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
    kind, topic = KINDS[i // len(TOPICS) % len(KINDS)], TOPICS[i % len(TOPICS)]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Write a long, detailed {kind} about {topic}."}]


def offsets(cfg: Config) -> dict[int, int]:
    """The first request index of each --clients level, so no two requests to a server repeat a prompt."""
    out, base = {}, 0
    for n in cfg.clients:
        out[n] = base
        base += n * cfg.requests_per_client
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- servers ---------------------------------------------------------------------------------

def _help_text(cmd: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> str:
    res = subprocess.run([*cmd, "--help"], capture_output=True, text=True, env={**os.environ, **(env or {})},
                         cwd=cwd)
    return res.stdout + res.stderr


def baseline_env(cfg: Config) -> dict[str, str]:
    """The environment that runs localrun from the baseline's worktree instead of this checkout."""
    assert cfg.baseline_tree is not None
    return {"PYTHONPATH": os.pathsep.join(p for p in (cfg.baseline_tree, os.environ.get("PYTHONPATH")) if p)}


def server_command(name: str, cfg: Config, port: int) -> tuple[list[str], str]:
    """The command line that starts one server, and the path that answers 200 once it is ready."""
    fa_on = cfg.flash_attn == "on"
    if name == "localrun" or name.startswith("localrun@"):
        base = [sys.executable, "-m", "localrun", "serve"]
        baseline = name != "localrun"
        help_text = _help_text(base, baseline_env(cfg) if baseline else None, cfg.baseline_tree if baseline else None)
        if "--parallel" not in help_text:
            raise SystemExit(f"`localrun serve` is not available here:\n{help_text.strip()[-500:]}")
        cmd = [*base, "--host", "127.0.0.1", "--port", str(port), "--parallel", str(cfg.parallel)]
        optional = [("--ctx", str(cfg.ctx)), ("--threads", str(cfg.threads)), ("--flash-attn", cfg.flash_attn)]
        if cfg.gpu_layers is not None:
            optional.append(("--gpu-layers", str(cfg.gpu_layers)))
        for flag, value in optional:
            if flag in help_text:
                cmd += [flag, value]
            else:
                print(f"warning: `localrun serve` has no {flag}; its default applies", file=sys.stderr)
        return cmd, "/health"
    if name == "llama-cpp-python":
        cmd = [sys.executable, "-m", "llama_cpp.server", "--model", cfg.path, "--model_alias", cfg.model,
               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(cfg.ctx), "--n_batch", "512",
               "--n_threads", str(cfg.threads), "--n_threads_batch", str(cfg.threads),
               "--flash_attn", str(fa_on).lower(), "--interrupt_requests", "false"]
        if cfg.gpu_layers is not None:
            cmd += ["--n_gpu_layers", str(cfg.gpu_layers)]
        return cmd, "/v1/models"
    if name == "llama-server":
        from llama_tools import llama_server_binary

        cmd = [str(llama_server_binary()), "-m", cfg.path, "--alias", cfg.model, "--host", "127.0.0.1",
               "--port", str(port), "-np", str(cfg.parallel), "-c", str(cfg.ctx * cfg.parallel), "--no-kv-unified",
               "-b", "512", "-ub", "512", "-t", str(cfg.threads), "-tb", str(cfg.threads), "-fa", cfg.flash_attn,
               "--no-webui"]
        if cfg.gpu_layers is not None:
            cmd += ["-ngl", str(cfg.gpu_layers)]
        return cmd, "/health"
    raise ValueError(name)


class Server:
    """A server process: started, waited for, and always stopped (its whole process group)."""

    def __init__(self, name: str, cfg: Config) -> None:
        self.name, self.cfg = name, cfg
        self.port = free_port()
        self.cmd, self.ready_path = server_command(name, cfg, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = cfg.logs / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        self.log = self.log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               **(baseline_env(self.cfg) if self.name.startswith("localrun@") else {})}
        # the baseline runs in its worktree: `python -m` puts the working directory first on sys.path
        cwd = self.cfg.baseline_tree if self.name.startswith("localrun@") else None
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.cfg.ready_timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # the server has no readiness push; /health is its declared state
        raise SystemExit(f"{self.name} was not ready after {self.cfg.ready_timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


# ---- clients ---------------------------------------------------------------------------------

async def one_request(client: Any, cfg: Config, i: int, max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: send time, content-chunk times, content, usage, finish reason."""
    body = {"model": cfg.model, "messages": messages(i), "stream": True, "max_tokens": max_tokens,
            "temperature": cfg.temperature, "stream_options": {"include_usage": True},
            **({"seed": 1000 + i} if cfg.temperature else {})}
    stamps: list[float] = []
    parts: list[str] = []
    usage = None
    finish = "none"
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {resp.status_code} from {client.base_url}: {text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if content := (delta.get("reasoning_content") or "") + (delta.get("content") or ""):
                    stamps.append(time.perf_counter())
                    parts.append(content)
                finish = choice.get("finish_reason") or finish
    return {"t0": t0, "end": time.perf_counter(), "stamps": stamps, "text": "".join(parts), "usage": usage,
            "finish": finish}


_VOCABS: dict[str, Any] = {}


def count_tokens(path: str, text: str) -> int:
    """Tokens in text by the model's own vocabulary: how every stream's delivery is counted."""
    if path not in _VOCABS:
        from llama_cpp import Llama

        _VOCABS[path] = Llama(model_path=path, vocab_only=True, verbose=False)
    return len(_VOCABS[path].tokenize(text.encode("utf-8"), add_bos=False, special=False)) if text else 0


async def run_level(server: Server, clients: int) -> Result:
    """`clients` concurrent streams, each its own httpx client, each doing requests_per_client requests."""
    import httpx

    cfg = server.cfg
    base = offsets(cfg)[clients]

    async def client_task(c: int) -> list[dict[str, Any]]:
        out = []
        limits = httpx.Limits(max_connections=1)
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(900, connect=10), limits=limits) as cl:
            for r in range(cfg.requests_per_client):
                out.append(await one_request(cl, cfg, base + c * cfg.requests_per_client + r, cfg.tokens))
        return out

    per_client = await asyncio.gather(*(client_task(c) for c in range(clients)))
    reqs = [r for rs in per_client for r in rs]
    start, end = min(r["t0"] for r in reqs), max(r["end"] for r in reqs)
    chunks = sum(len(r["stamps"]) for r in reqs)
    tokens = sum(count_tokens(cfg.path, r["text"]) for r in reqs)
    usage = sum(r["usage"] for r in reqs) if all(r["usage"] is not None for r in reqs) else None
    ttft = [r["stamps"][0] - r["t0"] for r in reqs if r["stamps"]]
    rates = [(len(s) - 1) / (s[-1] - s[0]) for s in (r["stamps"] for r in reqs) if len(s) > 1 and s[-1] > s[0]]
    finishes: dict[str, int] = {}
    for r in reqs:
        finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1
    wall = end - start
    return Result(server.name, clients, len(reqs), tokens, chunks, wall, tokens / wall, percentile(ttft, 50),
                  percentile(ttft, 95), statistics.median(rates) if rates else 0.0, usage, finishes)


def measure_server(name: str, cfg: Config) -> list[Result]:
    """Start one server, warm it up, measure every --clients level, stop it."""
    import httpx

    t = time.perf_counter()
    with Server(name, cfg) as server:
        up = time.perf_counter() - t
        # The first request loads the model where loading is lazy; it is not measured.
        asyncio.run(_warm_up(server))
        print(f"  {name}: ready in {up:.1f} s, warm-up done; log {server.log_path}", file=sys.stderr)
        results = []
        for n in cfg.clients:
            try:
                results.append(asyncio.run(run_level(server, n)))
            except (httpx.HTTPError, RuntimeError) as e:
                raise SystemExit(f"{name} at {n} clients failed: {e}\n{server.tail()}") from e
            r = results[-1]
            print(f"  {name} x{n}: {r.tok_s:.1f} tok/s, {r.tokens} tokens, TTFT p50 {r.ttft_p50:.2f} s,"
                  f" decode {r.decode_tok_s:.1f} tok/s/stream, finish {r.finish_reasons}", file=sys.stderr)
        return results


async def _warm_up(server: Server) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(300, connect=10)) as cl:
        await one_request(cl, server.cfg, WARM_UP, 8)


def measure_run(cfg: Config) -> Result:
    """`localrun run` in process: one stream at a time, the same prompts, LoadOptions and params."""
    from localrun import api
    from localrun.generation import Request
    from localrun.settings import GenerationParams, LoadOptions

    fa = {"on": True, "off": False}[cfg.flash_attn]
    gl: int | str = cfg.gpu_layers if cfg.gpu_layers is not None else "auto"
    session = api.load(cfg.model, LoadOptions(n_ctx=cfg.ctx, n_threads=cfg.threads, flash_attn=fa, gpu_layers=gl))
    params = GenerationParams(temperature=cfg.temperature, max_tokens=cfg.tokens)
    rates, ttft, tokens, chunks, usage = [], [], 0, 0, 0
    finishes: dict[str, int] = {}
    try:
        for _ in session.stream(Request.chat(messages(WARM_UP)), GenerationParams(temperature=0, max_tokens=8)):
            pass  # the warm-up the servers get
        base = offsets(cfg)[1]  # the one-client level's prompts
        t_start = time.perf_counter()
        for i in range(base, base + cfg.requests_per_client):
            stamps: list[float] = []
            parts: list[str] = []
            t0 = time.perf_counter()
            seeded = replace(params, seed=1000 + i) if cfg.temperature else params
            for chunk in session.stream(Request.chat(messages(i)), seeded):
                if chunk.done:
                    usage += chunk.completion_tokens
                    reason = chunk.finish_reason or "none"
                    finishes[reason] = finishes.get(reason, 0) + 1
                    break
                if chunk.thinking + chunk.text:  # a thinking model's thought is delivered text too
                    stamps.append(time.perf_counter())
                    parts.append(chunk.thinking + chunk.text)
            chunks += len(stamps)
            tokens += count_tokens(cfg.path, "".join(parts))
            if stamps:
                ttft.append(stamps[0] - t0)
            if len(stamps) > 1:
                rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
        wall = time.perf_counter() - t_start
    finally:
        session.close()
    return Result(RUN, 1, cfg.requests_per_client, tokens, chunks, wall, tokens / wall, percentile(ttft, 50),
                  percentile(ttft, 95), statistics.median(rates) if rates else 0.0, usage, finishes)


# ---- report ----------------------------------------------------------------------------------

def baseline_targets(baseline: str, clients: list[int]) -> tuple[tuple[str, int, str, str, str, float], ...]:
    """This checkout against --baseline's: throughput at every level, decode and TTFT at 1 client."""
    label = f"localrun / {baseline}"
    out = [(label, n, "localrun", baseline, "tok_s", 0.97) for n in clients]
    if 1 in clients:
        out += [(label, 1, "localrun", baseline, "decode_tok_s", 0.97),
                (f"{baseline} / localrun TTFT", 1, baseline, "localrun", "ttft_p50", 0.97)]
    return tuple(out)


def summarize(rounds: list[list[Result]], targets: tuple[tuple[str, int, str, str, str, float], ...] = TARGETS,
              ) -> tuple[dict[tuple[str, int], dict[str, float]], list[dict[str, Any]]]:
    """Medians per (server, clients) over rounds, and the target ratios (medians of per-round ratios).
    A TTFT ratio is written slower over faster (numerator and denominator swapped in its target)."""
    by: dict[tuple[str, int], list[Result]] = {}
    for rnd in rounds:
        for r in rnd:
            by.setdefault((r.server, r.clients), []).append(r)
    med = {k: {m: statistics.median(getattr(r, m) for r in rs)
               for m in ("tok_s", "ttft_p50", "ttft_p95", "decode_tok_s", "tokens", "chunks", "requests")}
           for k, rs in by.items()}
    ratios = []
    for label, clients, num, den, measure, target in targets:
        per_round = []
        for rnd in rounds:
            a = next((getattr(r, measure) for r in rnd if (r.server, r.clients) == (num, clients)), None)
            b = next((getattr(r, measure) for r in rnd if (r.server, r.clients) == (den, clients)), None)
            if a is not None and b:
                per_round.append(a / b)
        if per_round:
            value = statistics.median(per_round)
            ratios.append({"ratio": label, "clients": clients, "measure": measure, "value": value,
                           "per_round": per_round, "target": target, "pass": value >= target})
    return med, ratios


def print_table(cfg: Config, names: list[str], med: dict[tuple[str, int], dict[str, float]],
                ratios: list[dict[str, Any]], n_rounds: int) -> None:
    how = f"sampled at temperature {cfg.temperature}, seeded per request" if cfg.temperature else "greedy"
    print(f"model: {cfg.model} ({cfg.path}); {cfg.tokens} tokens per request, {how}; threads {cfg.threads};"
          f" ctx {cfg.ctx} per sequence; flash attention {cfg.flash_attn}; --parallel {cfg.parallel};"
          f" {cfg.requests_per_client} requests per client; {n_rounds} rounds, medians")
    cols = [n for n in [*names, RUN] if any(k[0] == n for k in med)]
    print(f"{'measure':<38}" + "".join(f"{c:>18}" for c in cols))
    rows = (("aggregate tok/s", "tok_s", "{:.1f}"), ("TTFT p50 (s)", "ttft_p50", "{:.2f}"),
            ("TTFT p95 (s)", "ttft_p95", "{:.2f}"), ("decode tok/s per stream", "decode_tok_s", "{:.1f}"),
            ("tokens delivered / requested", "tokens", None), ("content chunks", "chunks", "{:.0f}"))
    for n in cfg.clients:
        for label, key, fmt in rows:
            cells = []
            for c in cols:
                m = med.get((c, n))
                if m is None:
                    cells.append("")
                elif fmt is None:
                    cells.append(f"{m['tokens']:.0f}/{m['requests'] * cfg.tokens:.0f}")
                else:
                    cells.append(fmt.format(m[key]))
            if any(cells):
                print(f"{f'{n} client(s): {label}':<38}" + "".join(f"{c:>18}" for c in cells))
    if ratios:
        print(f"\n{'ratio (median of per-round ratios)':<48}{'clients':>8}{'value':>8}{'target':>9}{'':>6}")
        for r in ratios:
            what = {"tok_s": "tok/s", "decode_tok_s": "decode", "ttft_p50": ""}[r["measure"]]
            print(f"{r['ratio'] + ' ' + what:<48}{r['clients']:>8}{r['value']:>8.2f}{'>= ' + str(r['target']):>9}"
                  f"{'PASS' if r['pass'] else 'MISS':>6}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"a subset of {','.join(SERVERS)}")
    ap.add_argument("--clients", default="1,16", help="comma-separated concurrency levels")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default) is greedy; otherwise sampled, request i seeded 1000+i on every side")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--flash-attn", choices=("on", "off"), default="on")
    ap.add_argument("--gpu-layers", type=int, default=None, help="layers to offload (default: each server's own)")
    ap.add_argument("--no-run", action="store_true", help="skip the in-process `localrun run` reference")
    ap.add_argument("--ready-timeout", type=float, default=180)
    ap.add_argument("--baseline", metavar="REV", help="also time `localrun serve` as of this git revision")
    ap.add_argument("--json", type=Path, help="write the configuration, every round and the summary here")
    args = ap.parse_args()
    if args.baseline:
        return with_baseline(args, ap)
    return bench(args, ap)


def with_baseline(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    """Check REV out into a temporary worktree, run the benchmark with it, remove the worktree."""
    root = HERE.parent
    rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", args.baseline], capture_output=True,
                         text=True)
    if rev.returncode != 0:
        ap.error(f"--baseline {args.baseline}: not a revision of {root} ({rev.stderr.strip()})")
    tree = Path(tempfile.mkdtemp(prefix="bench-serve-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", str(tree), rev.stdout.strip()],
                   check=True, capture_output=True)
    try:
        return bench(args, ap, f"localrun@{rev.stdout.strip()}", str(tree))
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)], capture_output=True)


def bench(args: argparse.Namespace, ap: argparse.ArgumentParser, baseline: str | None = None,
          tree: str | None = None) -> int:

    names = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in names if s not in SERVERS]
    if unknown:
        ap.error(f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    clients = [int(c) for c in args.clients.split(",")]

    from localrun import api
    from localrun.settings import default_threads

    cfg = Config(model=args.model, path=str(api.get_model(args.model).path), tokens=args.tokens, clients=clients,
                 requests_per_client=args.requests_per_client, ctx=args.ctx,
                 threads=args.threads or default_threads(), flash_attn=args.flash_attn, gpu_layers=args.gpu_layers,
                 parallel=max(clients), ready_timeout=args.ready_timeout, baseline_tree=tree,
                 temperature=args.temperature)
    if baseline is not None:
        where = subprocess.run([sys.executable, "-c", "import localrun; print(localrun.__file__)"], text=True,
                               capture_output=True, env={**os.environ, **baseline_env(cfg)}, cwd=tree).stdout.strip()
        if not where.startswith(str(tree)):
            raise SystemExit(f"{baseline} would import localrun from {where}, not from its worktree {tree}")
        names = [*names, baseline]
    if "llama-server" in names:
        from llama_tools import llama_server_binary

        llama_server_binary()  # build it (once) before anything is timed
    turns = [*names, *([RUN] if "localrun" in names and 1 in clients and not args.no_run else [])]
    rounds: list[list[Result]] = []
    for i in range(args.rounds):
        order = turns if i % 2 == 0 else turns[::-1]
        print(f"round {i + 1}/{args.rounds}: {', '.join(order)}", file=sys.stderr)
        rnd: list[Result] = []
        for name in order:
            rnd += [measure_run(cfg)] if name == RUN else measure_server(name, cfg)
        rounds.append(rnd)
    targets = baseline_targets(baseline, clients) if baseline is not None else TARGETS
    med, ratios = summarize(rounds, targets)
    print_table(cfg, names, med, ratios, args.rounds)
    reported = {name: [(r.tokens, r.usage_tokens) for rnd in rounds for r in rnd if r.server == name] for name in turns}
    print("tokens delivered: every stream's content tokenized with the model's vocabulary, for every server alike;"
          " the servers' own usage said: " + "; ".join(
              f"{k} {sum(u for _, u in v if u is not None)} (counted here {sum(t for t, _ in v)})"
              if all(u is not None for _, u in v) else f"{k} (no usage sent)" for k, v in reported.items()))
    if args.json:
        out = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
               "rounds": [[asdict(r) for r in rnd] for rnd in rounds],
               "medians": [{"server": k[0], "clients": k[1], **v} for k, v in med.items()], "ratios": ratios}
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
