"""Decode speed of `localrun run` against a minimal llama-cpp-python decode loop, and the
start-up time of `localrun --help`. Ratios are measured in the same run (machines are noisy).

    python benchmarks/bench_run.py [--model NAME|PATH] [--tokens 256] [--rounds 3] [--gpu-layers N]

Targets: decode ratio >= 0.97; `localrun --help` <= 0.3 s.
"""

from __future__ import annotations

import argparse
import ctypes  # noqa: F401
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"


def baseline_decode(path: str, n_tokens: int, threads: int, gpu_layers: int) -> tuple[float, list[int]]:
    """The loop a user writes on llama-cpp-python's low-level API: greedy, one token per decode."""
    from localrun.backends.llama_loader import library

    ll = library()  # llama-cpp-python with the same quiet log sink as localrun, so both do the same work
    mp = ll.llama_model_default_params()
    mp.n_gpu_layers = gpu_layers
    model = ll.llama_model_load_from_file(path.encode(), mp)
    cp = ll.llama_context_default_params()
    cp.n_ctx = 4096
    cp.n_batch = 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = True
    ctx = ll.llama_init_from_model(model, cp)
    vocab = ll.llama_model_get_vocab(model)
    buf = (ll.llama_token * 64)()
    n = ll.llama_tokenize(vocab, PROMPT.encode(), len(PROMPT.encode()), buf, 64, True, False)
    ll.llama_decode(ctx, ll.llama_batch_get_one(buf, n))
    sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
    ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_greedy())
    tok_arr = (ll.llama_token * 1)()
    out: list[int] = []
    times: list[float] = []
    for _ in range(n_tokens):
        tok = ll.llama_sampler_sample(sampler, ctx, -1)
        if ll.llama_vocab_is_eog(vocab, tok):
            break
        out.append(tok)
        times.append(time.perf_counter())
        if len(out) == n_tokens:
            break
        tok_arr[0] = tok
        ll.llama_decode(ctx, ll.llama_batch_get_one(tok_arr, 1))
    ll.llama_sampler_free(sampler)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return (len(out) - 1) / (times[-1] - times[0]), out


def baseline_isolated(path: str, n_tokens: int, threads: int, gpu_layers: int) -> tuple[float, int]:
    """Run the baseline in a fresh interpreter, as a user's script would be."""
    code = (
        "import json,sys;sys.path.insert(0, sys.argv[1]);import bench_run as b;"
        "r,t=b.baseline_decode(sys.argv[2],int(sys.argv[3]),int(sys.argv[4]),int(sys.argv[5]));"
        "print(json.dumps([r,len(t)]))"
    )
    import json
    import os

    res = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)), path,
                          str(n_tokens), str(threads), str(gpu_layers)], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"baseline failed ({res.returncode}): {res.stderr[-2000:]}")
    rate, n = json.loads(res.stdout.strip().splitlines()[-1])
    return rate, n


def localrun_decode(model: str, n_tokens: int, threads: int, gpu_layers: int) -> tuple[float, int, dict]:
    """localrun's own path: the isolated engine, streamed to this process, timed here."""
    from localrun import api
    from localrun.generation import Request
    from localrun.settings import GenerationParams, LoadOptions

    session = api.load(model, LoadOptions(n_ctx=4096, n_threads=threads, gpu_layers=gpu_layers))
    info = session.info()
    stamps: list[float] = []
    try:
        for chunk in api.stream(session, Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=n_tokens)):
            if chunk.done:
                n = chunk.completion_tokens
                break
            stamps.append(time.perf_counter())
    finally:
        session.close()
    # One chunk per token unless a stop sequence or a split UTF-8 character held text back.
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]), n, info


def help_time(rounds: int = 7) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "localrun", "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=-1, help="-1: all (the default on GPU builds)")
    args = ap.parse_args()

    from localrun import api
    from localrun.settings import default_threads

    path = api.get_model(args.model).path
    threads = args.threads or default_threads()
    base, ours = [], []
    info: dict = {}
    ours_layers = args.gpu_layers if args.gpu_layers >= 0 else "auto"
    for r in range(args.rounds):
        # Who goes first alternates, so neither side always meets the machine as the other left it.
        if r % 2 == 0:
            b, n_base = baseline_isolated(path, args.tokens, threads, args.gpu_layers)
        o, n, info = localrun_decode(args.model, args.tokens, threads, ours_layers)  # type: ignore[arg-type]
        if r % 2 == 1:
            b, n_base = baseline_isolated(path, args.tokens, threads, args.gpu_layers)
        if n != n_base:
            print(f"warning: baseline made {n_base} tokens, localrun {n}", file=sys.stderr)
        base.append(b)
        ours.append(o)
    b, o = statistics.median(base), statistics.median(ours)
    h = help_time()
    print(f"model: {args.model} ({path}); threads {threads}; engine {info}")
    print(f"{'measure':<44}{'localrun':>12}{'baseline':>12}{'ratio':>8}{'target':>10}")
    print(f"{'decode tok/s (greedy, ' + str(args.tokens) + ' tokens, median)':<44}{o:>12.1f}{b:>12.1f}{o / b:>8.3f}{'>= 0.97':>10}")
    print(f"{'localrun --help wall time (s, median)':<44}{h:>12.3f}{'':>12}{'':>8}{'<= 0.3':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
