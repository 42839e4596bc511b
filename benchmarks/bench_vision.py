"""Images on the llama.cpp engine: time to first token and concurrent throughput against llama.cpp's
own multimodal tools, on the same files, in one run.

    python benchmarks/bench_vision.py [--rounds 5] [--repeats 3] [--tokens 64] [--threads N] [--ctx 2048]
        [--size 448] [--quiet-wait 30] [--model FILE --mmproj FILE] [--logs DIR] [--json FILE]

Files: a random Qwen2-VL of about 200M parameters (8 text layers of width 512, 8 vision blocks of
width 384, the real Qwen3 tokenizer, Qwen2-VL's chat template: tests/vision_models.py's recipe made
larger), written in Hugging Face layout and converted by llama.cpp's own convert_hf_to_gguf.py (the
llama-cpp-python sdist's) into an F16 text GGUF and an F16 projector, built once into
~/.cache/localrun-bench/vision/ (or give --model and --mmproj). Images: seeded --size x --size PNGs
(448: 1024 patches, 256 image tokens; sides that are multiples of 28 are not resized), a new one for
every measured request, the same ones on every side.

Sides (llama.cpp's built from the llama.cpp that llama-cpp-python vendors, benchmarks/llama_tools.py):
  localrun serve --parallel 4         OpenAI /v1/chat/completions, image_url data URIs, streamed
  llama-server --mmproj -np 4         the same requests (--no-kv-unified: ctx per sequence, as ours)
  localrun run --image                one shot: a process that loads, reads the image, answers, exits
  llama-mtmd-cli --image --jinja      one shot, rendering the model's own chat template as localrun does
All get the same threads, context per sequence, batch 512, flash attention on, greedy, --tokens per
reply, the same prompt and images. Server against server and one shot against one shot: a server's
TTFT has no load in it, a one shot's has.

Each round starts both servers (one after the other) and warms each up with one image request; then
it measures them in turn, the idle one waiting without using the CPU, so that the two measurements
of a pair are seconds apart on a machine whose load may change; then it runs the one-shot commands
in turn. Every measurement is repeated --repeats times per round with new images, the order of the
sides reversed every other time. Before each measurement it waits (up to --quiet-wait seconds) for
the CPU to be nearly idle (under 10% busy over half a second): other work on a shared machine comes
in bursts, and both engines' threads slow down many times over when they have to share the cores.
  (a) TTFT, server: request sent -> first content chunk, for an image the server has not seen.
      TTFT, one shot: process start -> first visible byte of the reply on stdout (loading included).
  (b) aggregate tokens/s of 4 concurrent streamed requests with 4 new images: completion tokens (the
      servers' usage) over the wall time from the first request sent to the last stream's end.
  (c) second turn: the conversation of (a) continued (its reply as the assistant turn, then a short
      question); TTFT of turn 1 over turn 2, on localrun serve and, for reference, llama-server.
Each measurement also records the share of the machine's CPU time that other processes took while
it ran (/proc/stat less this benchmark's own processes); one above 10% is disturbed. Values are
medians over rounds x repeats of the undisturbed measurements; localrun's advantage over llama.cpp is
the median of the ratios of the pairs measured back to back with neither disturbed (the table also
shows it over all pairs).

Targets (issue): localrun >= 1.0x llama-server and >= 1.0x llama-mtmd-cli in TTFT (their TTFT over
ours), >= 1.0x llama-server in 4-request tokens/s, and turn 2 >= 3x faster to its first token than
turn 1 on localrun serve.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import json
import os
import shutil
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
from bench_speculative import Server, free_port  # noqa: E402  (the same server lifecycle)

RECIPE = 1  # bump when the model below changes: it names the cache folder
TEXT = {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "ffn": 1536, "mrope": [8, 12, 12]}
VISION = {"depth": 8, "embed_dim": 384, "num_heads": 6, "mlp_ratio": 4}
PROMPT = "Describe this image in detail."
FOLLOW_UP = "Which colours stand out the most?"
NAME = "vision-bench"
CONCURRENT = 4
QUIET = 0.1  # the busy share of all cores under which the machine counts as quiet before a measurement
DISTURBED = 0.1  # the share of all cores that other processes took during a measurement that disturbed it
SERVE, LLAMA_SERVER, RUN, MTMD = "localrun serve", "llama-server", "localrun run", "llama-mtmd-cli"
SIDES = (SERVE, LLAMA_SERVER, RUN, MTMD)
TARGETS = (  # (label, measure, numerator side, denominator side, target): ratio = num / den
    ("TTFT, server: llama-server / localrun serve", "ttft", LLAMA_SERVER, SERVE, 1.0),
    ("TTFT, one shot: llama-mtmd-cli / localrun run", "ttft", MTMD, RUN, 1.0),
    ("4 requests tok/s: localrun serve / llama-server", "tok_s", SERVE, LLAMA_SERVER, 1.0),
    ("turn 1 / turn 2 TTFT, localrun serve", "reuse", SERVE, SERVE, 3.0),
)


def log(msg: str) -> None:
    print(f"bench_vision: {msg}", file=sys.stderr, flush=True)


def cache() -> Path:
    base = Path(os.environ.get("LOCALRUN_BENCH_CACHE") or Path.home() / ".cache" / "localrun-bench")
    return base / "vision"


# ---- files -----------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """The text GGUF, the projector and the images: a warm-up one, one per repeat for the TTFT
    requests and CONCURRENT per repeat for the concurrent ones, all different (seeded test images)."""
    from tests.vision_models import test_image

    folder = cache() / f"qwen2vl-bench-r{RECIPE}"
    if args.model and args.mmproj:
        model, mmproj = Path(args.model), Path(args.mmproj)
    else:
        hf = folder / "Qwen2-VL-bench"  # the converter names the model after the folder
        if not (hf / "config.json").is_file():
            build_checkpoint(hf)
        model, mmproj = folder / "qwen2vl-bench-f16.gguf", folder / "mmproj-qwen2vl-bench-f16.gguf"
        for out, projector in ((mmproj, True), (model, False)):
            if not out.is_file():
                convert(hf, out, projector)
    pics = folder / "images"
    s = args.size

    def image(seed: int) -> Path:
        path = pics / f"image-{s}-{seed}.png"
        return path if path.is_file() else test_image(path, s, s, seed)

    images = {"warm-up": image(0), "ttft": [image(1 + k) for k in range(args.repeats)],
              "concurrent": [[image(1000 + CONCURRENT * k + j) for j in range(CONCURRENT)] for k in range(args.repeats)]}
    return model, mmproj, images


def build_checkpoint(hf: Path) -> None:
    """tests/vision_models.py's random Qwen2-VL, wider and deeper, written aside and renamed."""
    import torch
    import transformers as tf

    from tests import vision_models as vm

    log(f"building a random Qwen2-VL checkpoint in {hf}")
    tok = tf.AutoTokenizer.from_pretrained(str(vm.TOKENIZER))
    special = {name: tok.convert_tokens_to_ids(name) for name in
               ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    assert sum(TEXT["mrope"]) * 2 == TEXT["hidden"] // TEXT["heads"]
    config = tf.Qwen2VLConfig(
        text_config={
            "vocab_size": len(tok), "hidden_size": TEXT["hidden"], "intermediate_size": TEXT["ffn"],
            "num_hidden_layers": TEXT["layers"], "num_attention_heads": TEXT["heads"],
            "num_key_value_heads": TEXT["kv_heads"], "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": TEXT["mrope"]},
            "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        },
        vision_config={**VISION, "hidden_size": TEXT["hidden"], "patch_size": vm.PATCH, "in_channels": 3,
                       "spatial_merge_size": vm.MERGE, "temporal_patch_size": vm.TEMPORAL},
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.Qwen2VLForConditionalGeneration(config)
    vm._peak(model, seed=0)  # unit-scale weights whose greedy text depends on the image
    hf.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=hf.parent))
    try:
        work.chmod(0o755)  # mkdtemp's 0700
        model.save_pretrained(work)
        tok.chat_template = vm.CHAT_TEMPLATE
        tok.save_pretrained(work)
        vm._image_processor()(
            min_pixels=vm.MIN_PIXELS, max_pixels=vm.MAX_PIXELS, patch_size=vm.PATCH, merge_size=vm.MERGE,
            temporal_patch_size=vm.TEMPORAL, image_mean=vm.IMAGE_MEAN, image_std=vm.IMAGE_STD,
        ).save_pretrained(work)
        path = work / "config.json"  # the converter's --mmproj looks for `architectures` at the top
        saved = json.loads(path.read_text())
        saved["architectures"] = ["Qwen2VLForConditionalGeneration"]
        path.write_text(json.dumps(saved, indent=2) + "\n")
        work.rename(hf)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def convert(hf: Path, out: Path, projector: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py (the vendored one) of hf into out as F16, atomically."""
    from llama_tools import cache_root, llama_cpp_version, source_dir

    script = source_dir(cache_root(), llama_cpp_version()) / "convert_hf_to_gguf.py"
    part = out.with_name(f".{out.name}.part")
    log(f"converting {hf.name} into {out.name}")
    cmd = [sys.executable, str(script), str(hf), "--outtype", "f16", "--outfile", str(part),
           *(["--mmproj"] if projector else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        raise SystemExit(f"llama.cpp's converter failed ({' '.join(cmd[1:])}):\n{proc.stderr[-3000:]}")
    os.replace(part, out)


# ---- requests --------------------------------------------------------------------------------

def user_turn(image: Path, text: str) -> dict[str, Any]:
    """An OpenAI user message: the image first (a PNG data URI), then the text."""
    uri = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                        {"type": "text", "text": text}]}


MODEL_FILE: list[Path] = []  # the GGUF every server runs (set by main): its vocabulary counts the replies


def chat(url: str, messages: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """One streamed chat completion: send time, first and last content times, text, completion tokens."""
    import httpx

    body = {"model": NAME, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    parts: list[str] = []
    first = None
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            raise SystemExit(f"HTTP {resp.status_code} from {url}: {resp.read().decode(errors='replace')[:1000]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices") or ():
                if text := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    parts.append(text)
    end = time.perf_counter()
    text = "".join(parts)
    # tokens counted on the client's side, by the model's own vocabulary, the same for every server
    return {"t0": t0, "ttft": (first or end) - t0, "end": end, "text": text,
            "tokens": count_tokens(str(MODEL_FILE[0]), text), "server_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens"), "server_prompt_ms": timings.get("prompt_ms")}


def conversation(url: str, image: Path, tokens: int) -> dict[str, Any]:
    """(a) a new image's first turn, then (c) its second turn: the reply kept, a short question added."""
    first = chat(url, [user_turn(image, PROMPT)], tokens)
    second = chat(url, [user_turn(image, PROMPT), {"role": "assistant", "content": first["text"]},
                        {"role": "user", "content": FOLLOW_UP}], tokens)
    return {"ttft": first["ttft"], "ttft2": second["ttft"], "reuse": first["ttft"] / second["ttft"],
            "text": first["text"], "prompt_tokens": [first["prompt_tokens"], second["prompt_tokens"]],
            "server_prompt_ms": [first["server_prompt_ms"], second["server_prompt_ms"]]}


def concurrent_requests(url: str, images: list[Path], tokens: int) -> dict[str, Any]:
    """(b) one request per image, all at once: completion tokens over the wall time of them all."""
    with concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        done = list(pool.map(lambda im: chat(url, [user_turn(im, PROMPT)], tokens), images))
    wall = max(d["end"] for d in done) - min(d["t0"] for d in done)
    n = sum(d["tokens"] for d in done)
    return {"tok_s": n / wall, "tokens": n, "wall": wall, "ttfts": [d["ttft"] for d in done]}


def one_shot(cmd: list[str], env: dict[str, str], logfile: Path) -> dict[str, Any]:
    """Run a one-shot command: time to the first visible byte of its stdout, wall time, what it printed."""
    with logfile.open("ab") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, bufsize=0)
        assert proc.stdout is not None
        head = b""
        while not head.strip() and (byte := proc.stdout.read(1)):  # llama-mtmd-cli prints a newline first
            head += byte
        first = time.perf_counter()
        rest = proc.stdout.read()
        rc = proc.wait()
        end = time.perf_counter()
    if rc != 0:
        raise SystemExit(f"{cmd[0]} failed ({rc}):\n{logfile.read_text(errors='replace')[-3000:]}")
    return {"ttft": first - t0, "wall": end - t0, "text": (head + rest).decode(errors="replace").strip()}


# ---- sides -----------------------------------------------------------------------------------

def sides(args: argparse.Namespace, model: Path, mmproj: Path, images: dict[str, Any], home: Path, logs: Path,
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The servers (name -> a function making its Server) and the one-shot commands (name -> a
    function running it once on the k-th TTFT image); localrun's store is home, with the model added."""
    from llama_tools import tool_binary

    server_bin = tool_binary("llama-server", also=("llama-mtmd-cli",))
    mtmd_bin = server_bin.parent / "llama-mtmd-cli"
    t, ctx, n = str(args.threads), str(args.ctx), str(args.tokens)
    env = {**os.environ, "LOCALRUN_HOME": str(home), "LOCALRUN_API_KEY": "", "PYTHONUNBUFFERED": "1"}
    subprocess.run([sys.executable, "-m", "localrun", "add", str(model), "--name", NAME, "--mmproj", str(mmproj)],
                   check=True, env=env, capture_output=True)
    # Python's bytecode for localrun, as an installed package has it (pip compiles at install) and
    # as any second run of a source checkout finds it: never compiled again in each measured process,
    # even where PYTHONDONTWRITEBYTECODE keeps Python from writing it.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "localrun")], check=True, capture_output=True)
    localrun = [sys.executable, "-m", "localrun"]
    engine = ["--ctx", ctx, "--threads", t, "--flash-attn", "on"]

    def serve() -> Server:
        port = free_port()
        cmd = [*localrun, "serve", "--port", str(port), "--parallel", str(CONCURRENT), *engine]
        return Server(SERVE, cmd, "/api/version", port, logs, env)

    def llama_server() -> Server:
        port = free_port()
        cmd = [str(server_bin), "-m", str(model), "--mmproj", str(mmproj), "--alias", NAME, "--host", "127.0.0.1",
               "--port", str(port), "-np", str(CONCURRENT), "-c", str(args.ctx * CONCURRENT), "--no-kv-unified",
               "-b", "512", "-ub", "512", "-t", t, "-tb", t, "-fa", "on", "--jinja", "--no-webui"]
        return Server(LLAMA_SERVER, cmd, "/health", port, logs, dict(os.environ))

    def run(k: int) -> dict[str, Any]:
        cmd = [*localrun, "run", str(model), PROMPT, "--mmproj", str(mmproj), "--image", str(images["ttft"][k]),
               "--temperature", "0", "--max-tokens", n, *engine]
        return one_shot(cmd, env, logs / "localrun-run.log")

    def mtmd(k: int) -> dict[str, Any]:
        cmd = [str(mtmd_bin), "-m", str(model), "--mmproj", str(mmproj), "--image", str(images["ttft"][k]),
               "-p", PROMPT, "--jinja", "--temp", "0", "-n", n, "-c", ctx, "-b", "512", "-ub", "512",
               "-t", t, "-tb", t, "-fa", "on"]
        return one_shot(cmd, dict(os.environ), logs / "llama-mtmd-cli.log")

    return {SERVE: serve, LLAMA_SERVER: llama_server}, {RUN: run, MTMD: mtmd}


def cpu_ticks(groups: list[int]) -> tuple[int, int, float]:
    """Clock ticks so far: the machine's busy and total (all cores), and this benchmark's own (this
    process, the children it has waited for, and every process of the servers' process groups);
    all zero where there is no /proc (the machine then always counts as quiet)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return 0, 0, 0.0
    t = os.times()
    own = (t.user + t.system + t.children_user + t.children_system) * os.sysconf("SC_CLK_TCK")
    for stat in Path("/proc").glob("[0-9]*/stat") if groups else ():
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended meanwhile
            continue
        if int(fields[2]) in groups:
            own += int(fields[11]) + int(fields[12])
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks), own  # busy: all but idle and iowait


def wait_quiet(limit: float) -> float:
    """Wait up to limit seconds, in half-second looks, for other processes to leave the CPU nearly
    idle (a shared machine's load comes in bursts); the seconds waited beyond the first look, -1 if
    in vain."""
    start, looks = time.monotonic(), 0
    while limit > 0:
        busy0, all0, _ = cpu_ticks([])
        time.sleep(0.5)
        busy1, all1, _ = cpu_ticks([])
        looks += 1
        if (busy1 - busy0) / max(all1 - all0, 1) < QUIET:
            return 0.0 if looks == 1 else time.monotonic() - start
        if time.monotonic() - start >= limit:
            return -1.0
    return 0.0


def turns(r: int, k: int, names: list[str]) -> list[str]:
    """The order of the sides for the k-th measurement of round r: reversed every other time."""
    return names if (r + k) % 2 == 0 else names[::-1]


def one_round(r: int, servers: dict[str, Any], one_shots: dict[str, Any], images: dict[str, Any],
              args: argparse.Namespace) -> dict[str, Any]:
    """Both servers up (the idle one waits without using the CPU), measured in turn; then the one-shot
    commands in turn. One record per measurement: its side, kind and repeat, what it measured, the
    seconds waited for a quiet CPU before it and the share of the machine's CPU time that other
    processes took while it ran ("foreign")."""
    records: list[dict[str, Any]] = []
    groups: list[int] = []

    def keep(side: str, kind: str, k: int, measure: Any, *a: Any) -> None:
        waited = wait_quiet(args.quiet_wait)
        busy0, all0, own0 = cpu_ticks(groups)
        got = measure(*a)
        busy1, all1, own1 = cpu_ticks(groups)
        foreign = max(0.0, (busy1 - busy0 - (own1 - own0)) / max(all1 - all0, 1)) if all1 else 0.0
        records.append({"side": side, "kind": kind, "repeat": k, **got, "waited": waited, "foreign": foreign})

    with contextlib.ExitStack() as stack:
        up = {name: stack.enter_context(make()) for name, make in servers.items()}
        groups += [server.proc.pid for server in up.values()]  # each server leads its own session
        for server in up.values():  # loads the model (localrun loads on the first request) and warms it up
            chat(server.url, [user_turn(images["warm-up"], PROMPT)], args.tokens)
        for k in range(args.repeats):
            for name in turns(r, k, list(up)):
                keep(name, "conversation", k, conversation, up[name].url, images["ttft"][k], args.tokens)
        for k in range(args.repeats):
            for name in turns(r, k, list(up)):
                keep(name, "concurrent", k, concurrent_requests, up[name].url, images["concurrent"][k], args.tokens)
    groups.clear()
    for k in range(args.repeats):
        for name in turns(r, k, list(one_shots)):
            keep(name, "one shot", k, one_shots[name], k)
    return {"load": os.getloadavg()[0], "records": records}


# ---- report ----------------------------------------------------------------------------------

def clean(record: dict[str, Any]) -> bool:
    return bool(record["foreign"] <= DISTURBED)


def values(rounds: list[dict[str, Any]], side: str, key: str, only_clean: bool = True) -> list[Any]:
    """side's key over every round and repeat; only undisturbed measurements where there are any."""
    got = [rec for rnd in rounds for rec in rnd["records"] if rec["side"] == side and key in rec]
    return [rec[key] for rec in ([r for r in got if clean(r)] if only_clean else []) or got]


def pairs(rounds: list[dict[str, Any]], key: str, num: str, den: str) -> list[tuple[float, bool]]:
    """num's key / den's for each pair measured back to back (same round, kind and repeat), and
    whether neither measurement of the pair was disturbed."""
    out = []
    for rnd in rounds:
        for a in (rec for rec in rnd["records"] if rec["side"] == num and key in rec):
            b = next(rec for rec in rnd["records"] if (rec["side"], rec["kind"], rec["repeat"]) == (den, a["kind"], a["repeat"]))
            out.append((a[key] / b[key], clean(a) and clean(b)))
    return out


def advantage(rounds: list[dict[str, Any]], key: str, num: str, den: str) -> float:
    """The median ratio over the undisturbed pairs (over all pairs where every one was disturbed)."""
    got = pairs(rounds, key, num, den)
    return median([v for v, ok in got if ok] or [v for v, _ in got])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(args: argparse.Namespace, model: Path, mmproj: Path, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the markdown tables; return the medians, the targets and every round for --json."""
    def med(side: str, key: str) -> float:
        return median(values(rounds, side, key))

    n = len(rounds) * args.repeats
    print(f"model {model.name} + {mmproj.name}, images {args.size}x{args.size}; "
          f"{len(rounds)} rounds x {args.repeats} repeats; {args.threads} threads, ctx {args.ctx} per sequence, "
          f"batch 512, flash attention on, greedy, {args.tokens} tokens per reply. Medians of the measurements "
          f"that other processes did not disturb (took under {DISTURBED:.0%} of the CPU while they ran)\n")
    print("| measure | localrun | llama.cpp | localrun's advantage | undisturbed pairs | over all pairs |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = (("TTFT, server: serve vs llama-server (s)", SERVE, LLAMA_SERVER, "ttft", True),
            ("TTFT, one shot incl. load: run vs llama-mtmd-cli (s)", RUN, MTMD, "ttft", True),
            ("one shot, whole command (s)", RUN, MTMD, "wall", True),
            ("turn-2 TTFT, server (s)", SERVE, LLAMA_SERVER, "ttft2", True),
            (f"{CONCURRENT} image requests at once, tok/s", SERVE, LLAMA_SERVER, "tok_s", False))
    for label, ours, theirs, key, lower_better in rows:
        num, den = (theirs, ours) if lower_better else (ours, theirs)
        every = pairs(rounds, key, num, den)
        digits = 3 if lower_better else 1
        print(f"| {label} | {med(ours, key):.{digits}f} | {med(theirs, key):.{digits}f} | "
              f"{advantage(rounds, key, num, den):.2f}x | {sum(ok for _, ok in every)}/{len(every)} | "
              f"{median([v for v, _ in every]):.2f}x |")
    print(f"| turn 1 / turn 2 TTFT, server (prefix reuse) | {med(SERVE, 'reuse'):.1f}x | {med(LLAMA_SERVER, 'reuse'):.1f}x"
          f" | | | |")
    prompt = {side: "/".join(map(str, values(rounds, side, "prompt_tokens", False)[0])) for side in (SERVE, LLAMA_SERVER)}
    tokens = {side: values(rounds, side, "tokens", False) for side in (SERVE, LLAMA_SERVER)}
    print(f"\nprompt tokens of turns 1 and 2 as each server's usage counts them: localrun {prompt[SERVE]}, llama-server "
          f"{prompt[LLAMA_SERVER]}; completion tokens of the {CONCURRENT} requests: localrun {min(tokens[SERVE])}-"
          f"{max(tokens[SERVE])}, llama-server {min(tokens[LLAMA_SERVER])}-{max(tokens[LLAMA_SERVER])} "
          f"(of {CONCURRENT * args.tokens})")
    texts = {side: values(rounds, side, "text", False) for side in SIDES}
    compared = ((SERVE, LLAMA_SERVER), (RUN, MTMD), (SERVE, RUN))
    differ = sum(a != b for x, y in compared for a, b in zip(texts[x], texts[y], strict=True))
    print(f"greedy replies to the TTFT requests: {differ} of {len(compared) * n} pairs differ "
          "(serve vs llama-server, run vs llama-mtmd-cli, serve vs run)")
    waited = [w for side in SIDES for w in values(rounds, side, "waited", False)]
    loads = ", ".join(f"{rnd['load']:.1f}" for rnd in rounds)
    print(f"waited for a quiet CPU (under {QUIET:.0%} busy) before {sum(w != 0 for w in waited)} of {len(waited)} "
          f"measurements, {sum(w for w in waited if w > 0):.0f} s in all, and {waited.count(-1.0)} times gave up after "
          f"{args.quiet_wait:.0f} s; "
          f"disturbed measurements: " + ", ".join(
              f"{side} {sum(f > DISTURBED for f in values(rounds, side, 'foreign', False))}" for side in SIDES)
          + f"; load average (1 min) after each round: {loads} ({os.cpu_count()} cores)")
    print("\n| target | value | wanted | |")
    print("|---|---:|---:|---|")
    out: dict[str, Any] = {"config": vars(args), "model": str(model), "mmproj": str(mmproj), "targets": [],
                           "medians": {side: {k: med(side, k) for k in ("ttft", "ttft2", "reuse", "tok_s", "wall")
                                              if values(rounds, side, k)} for side in SIDES},
                           "rounds": rounds}
    for label, key, num, den, want in TARGETS:
        value = med(num, key) if key == "reuse" else advantage(rounds, key, num, den)
        print(f"| {label} | {value:.2f} | >= {want} | {'PASS' if value >= want else 'MISS'} |")
        out["targets"].append({"target": label, "value": value, "wanted": want, "pass": value >= want})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds, each with fresh processes (at least 3)")
    p.add_argument("--repeats", type=int, default=3, help="measurements of each kind per round, new images each")
    p.add_argument("--tokens", type=int, default=64, help="max tokens per reply")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--ctx", type=int, default=2048, help="context per sequence")
    p.add_argument("--size", type=int, default=448, help="image side in pixels (a multiple of 28)")
    p.add_argument("--model", help="a vision model's text GGUF (default: the random Qwen2-VL built here)")
    p.add_argument("--mmproj", help="its projector GGUF")
    p.add_argument("--quiet-wait", type=float, default=30,
                   help="before each measurement wait up to this many seconds for the CPU to be idle (0: never)")
    p.add_argument("--logs", type=Path, help="keep the servers' and commands' logs in this folder")
    p.add_argument("--json", type=Path, help="write the configuration, medians, targets and every measurement here")
    args = p.parse_args()
    if args.rounds < 3 or args.repeats < 1:
        p.error("--rounds must be at least 3 and --repeats at least 1")
    if bool(args.model) != bool(args.mmproj):
        p.error("--model and --mmproj go together")
    model, mmproj, images = prepare(args)
    MODEL_FILE[:] = [model]
    work = Path(tempfile.mkdtemp(prefix="bench-vision-"))
    logs = args.logs or work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        servers, one_shots = sides(args, model, mmproj, images, work / "home", logs)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            rounds.append(one_round(r, servers, one_shots, images, args))
            last = rounds[-1:]
            disturbed = sum(not clean(rec) for rec in rounds[-1]["records"])
            log(f"round {r + 1}/{args.rounds} ({disturbed} measurements disturbed): TTFT "
                + " / ".join(f"{side} {median(values(last, side, 'ttft')):.3f} s" for side in SIDES)
                + f"; x{CONCURRENT} {median(values(last, SERVE, 'tok_s')):.1f} / "
                f"{median(values(last, LLAMA_SERVER, 'tok_s')):.1f} tok/s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = report(args, model, mmproj, rounds)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0 if all(t["pass"] for t in out["targets"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
