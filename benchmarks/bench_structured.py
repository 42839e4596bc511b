"""Structured output: what a JSON schema costs localrun's batched decoding, and what the
alternative a user has costs.

    python benchmarks/bench_structured.py [--model NAME|PATH] [--rows 16] [--tokens 128] [--rounds 3]

Three measurements, in the same run, alternating, medians reported:
1. localrun, 16 rows in one batch under a realistic extraction schema, against the same rows
   with no constraint (the same session, prompts, seeds and settings). Target: >= 0.9x the
   unconstrained generated tokens per second. The share of outputs that validate is shown for
   both (the unconstrained rows are asked for JSON in the prompt only).
2. llama-cpp-python's high-level loop, `Llama.create_chat_completion(response_format={"type":
   "json_object", "schema": ...})`, row after row, with the same threads and settings, in its own
   process. Target for localrun: 100% of outputs validate.
3. Tool calls under tool_choice "required" through each server with openai-python, on the same
   prompts: localrun serve against llama.cpp's llama-server --jinja (built by llama_tools.py): the
   share of replies that carry a call whose arguments validate against the function's schema.
4. Why llguidance: the per-token cost of computing the grammar's token mask over the whole
   vocabulary on the same schema, llguidance against llama.cpp's own grammar sampler
   (llama_sampler_init_grammar, the schema converted by llama-cpp-python's json_schema_to_gbnf).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9._-]{1,24}@[a-z0-9-]{1,20}[.][a-z]{2,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "plan": {"enum": ["free", "pro", "team"]},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "email", "age", "plan", "interests", "address"],
    "additionalProperties": False,
}
PEOPLE = ["Ann Lee", "Bob Stone", "Carla Diaz", "Dev Patel", "Eve Moss", "Finn Hart", "Gia Rossi", "Hugo Brandt",
          "Iris Cole", "Jon Park", "Kai Nakamura", "Lena Fox", "Max Ruiz", "Nia Obi", "Otto Berg", "Pia Lund"]


def prompt(i: int) -> str:
    who = PEOPLE[i % len(PEOPLE)]
    return (f"Extract the customer record as JSON with name, email, age, plan, interests and address.\n"
            f"Text: {who}, {20 + 3 * i} years old, signed up for the pro plan, lives in Springfield (zip 4{i:04d}), "
            f"likes hiking and chess, mail {who.split()[0].lower()}@example.com.")


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def localrun_round(session: Any, budgets: list[int], grammar: str | None) -> tuple[float, list[int], float]:
    """(generated tokens per second of wall time, tokens of each row, share of rows that validate)."""
    from dataclasses import asdict

    from localrun.backends.base import RowResult
    from localrun.generation import Request
    from localrun.settings import GenerationParams

    rows = [(i, Request.chat([{"role": "user", "content": prompt(i)}]),
             GenerationParams(temperature=0.7, seed=i, max_tokens=b, grammar=grammar)) for i, b in enumerate(budgets)]
    t = time.perf_counter()
    out = {e.id: asdict(e) for e in session.generate_many(rows) if isinstance(e, RowResult)}
    wall = time.perf_counter() - t
    counts = [out[i].get("completion_tokens", 0) for i in range(len(budgets))]
    return sum(counts) / wall, counts, sum(valid(r.get("text", "")) for r in out.values()) / len(budgets)


HIGH_LEVEL = r"""
import json, sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
schema, prompts = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
t = time.perf_counter(); n = 0; texts = []
for i, p in enumerate(prompts):
    out = llm.create_chat_completion(messages=[{"role": "user", "content": p}], max_tokens=tokens, temperature=0.7,
                                     seed=i, response_format={"type": "json_object", "schema": schema})
    n += out["usage"]["completion_tokens"]; texts.append(out["choices"][0]["message"]["content"])
print(json.dumps({"seconds": time.perf_counter() - t, "tokens": n, "texts": texts}))
"""


def high_level_round(path: str, n: int, tokens: int, threads: int) -> tuple[float, Any, float]:
    res = subprocess.run([sys.executable, "-c", HIGH_LEVEL, path, str(threads), str(tokens)],
                         input=json.dumps([SCHEMA, [prompt(i) for i in range(n)]]), capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"llama-cpp-python failed: {res.stderr[-2000:]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return r["tokens"] / r["seconds"], r["tokens"], sum(map(valid, r["texts"])) / n


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                        "parameters": {"type": "object", "properties": {
                                            "city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
                                            "required": ["city", "unit"]}}}
CITIES = ["Paris", "Oslo", "Lima", "Kyiv", "Pune", "Rome", "Cairo", "Quito"]


def tool_call_share(name: str, model: Any, n: int, threads: int) -> float:
    """Share of n tool_choice=required replies from a server that carry a call that validates."""
    import jsonschema
    import openai

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from bench_serve import Config, Server

    cfg = Config(model=model.name, path=model.path, tokens=96, clients=[1], requests_per_client=1, ctx=2048,
                 threads=threads, flash_attn="auto", gpu_layers=None, parallel=1, ready_timeout=600)
    server = Server(name, cfg)
    if name == "llama-server":
        server.cmd = [*server.cmd, "--jinja"]
    good = 0
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        for i in range(n):
            try:
                res = client.chat.completions.create(
                    model=model.name, messages=[{"role": "user", "content": f"What is the weather in {CITIES[i % 8]}?"}],
                    tools=[TOOL], tool_choice="required", max_tokens=96, temperature=0.7, seed=i)
            except openai.APIError as e:
                print(f"{name}: {e}", file=sys.stderr)
                continue
            for call in res.choices[0].message.tool_calls or []:
                try:
                    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])
                    good += call.function.name == "get_weather"
                    break
                except (ValueError, jsonschema.ValidationError):
                    pass
    return good / n


def mask_costs(path: str, text: str) -> tuple[float, float]:
    """Median ms per token to compute the mask over the vocabulary: llguidance, llama.cpp's grammar."""
    import ctypes

    import llama_cpp as ll
    import numpy as np
    from llama_cpp import llama_grammar
    from llguidance import LLMatcher
    from llguidance.llamacpp import lltokenizer_from_vocab

    from localrun.constraint import Constraint

    quiet = ll.llama_log_callback(lambda *_: None)
    ll.llama_log_set(quiet, ctypes.c_void_p(0))
    ll.llama_backend_init()
    model = ll.llama_model_load_from_file(path.encode(), ll.llama_model_default_params())
    vocab = ll.llama_model_get_vocab(model)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    tok = lltokenizer_from_vocab(vocab)
    tokens = tok.tokenize_str(text)
    m = LLMatcher(tok, Constraint.schema(SCHEMA).grammar)
    bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    llg = []
    for t in tokens:
        s = time.perf_counter()
        m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        llg.append(time.perf_counter() - s)
        m.consume_token(t)
    gbnf = llama_grammar.json_schema_to_gbnf(json.dumps(SCHEMA))
    sampler = ll.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    data = (ll.llama_token_data * n_vocab)()
    native = []
    for t in tokens:
        for i in range(n_vocab):
            data[i].id, data[i].logit, data[i].p = i, 0.0, 0.0
        arr = ll.llama_token_data_array(data=data, size=n_vocab, selected=-1, sorted=False)
        s = time.perf_counter()
        ll.llama_sampler_apply(sampler, ctypes.byref(arr))
        native.append(time.perf_counter() - s)
        ll.llama_sampler_accept(sampler, t)
    ll.llama_sampler_free(sampler)
    ll.llama_model_free(model)
    return statistics.median(llg) * 1000, statistics.median(native) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from localrun import api
    from localrun.constraint import Constraint
    from localrun.settings import LoadOptions, default_threads

    model = api.get_model(args.model)
    threads = default_threads()
    grammar = Constraint.schema(SCHEMA).grammar
    session = api.load(model, LoadOptions(n_ctx=512, n_parallel=args.rows, n_threads=threads))
    results: dict[str, list[tuple[float, Any, float]]] = {"constrained": [], "free": [], "high-level": []}
    try:
        localrun_round(session, [8] * args.rows, grammar)  # warm up: pages, compiled grammar
        runs = {
            "constrained": lambda: localrun_round(session, [args.tokens] * args.rows, grammar),
            # The same rows, each given the token count its latest constrained run generated (the
            # same seeds): the batch then has the same occupancy step by step, and the difference
            # is the grammar's cost.
            "free": lambda: localrun_round(session, results["constrained"][-1][1], None),
            "high-level": lambda: high_level_round(model.path, args.rows, args.tokens, threads),
        }
        for r in range(args.rounds):
            # Who goes first alternates; the first round runs the constrained rows first, so
            # "free" always has their counts.
            for k in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                results[k].append(runs[k]())
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1][0]:.1f} tok/s" for k, v in results.items()), file=sys.stderr)
    finally:
        session.close()
    med = {k: statistics.median(x[0] for x in v) for k, v in results.items()}
    share = {k: statistics.median(x[2] for x in v) for k, v in results.items()}
    example = json.dumps({"name": "Ann Lee", "email": "ann@example.com", "age": 20, "plan": "pro",
                          "interests": ["hiking", "chess"], "address": {"city": "Springfield", "zip": "40000"}})
    llg_ms, native_ms = mask_costs(model.path, example)
    calls = {name: tool_call_share(name, model, args.rows, threads) for name in ("localrun", "llama-server")}
    print(f"\nstructured output, {args.rows} rows x up to {args.tokens} tokens, {threads} threads, "
          f"median of {args.rounds} rounds ({model.name})\n")
    print(f"| {'run':47} | {'tok/s':>7} | {'valid':>6} | {'ratio':>6} |")
    print(f"|{'-' * 49}|{'-' * 9}|{'-' * 8}|{'-' * 8}|")
    rows = [("localrun batch, schema (llguidance)", "constrained"), ("localrun batch, no constraint", "free"),
            ("llama-cpp-python create_chat_completion, schema", "high-level")]
    for label, k in rows:
        print(f"| {label:47} | {med[k]:7.1f} | {share[k] * 100:5.0f}% | {med['constrained'] / med[k]:5.2f}x |")
    same = statistics.median(sum(f[1]) / sum(c[1]) for c, f in zip(results["constrained"], results["free"], strict=True))
    print(f"\nconstrained / unconstrained: {med['constrained'] / med['free']:.3f}x (target >= 0.9); "
          f"the unconstrained rows generated {same * 100:.0f}% of the constrained rows' tokens")
    print(f"constrained / llama-cpp-python high-level: {med['constrained'] / med['high-level']:.2f}x")
    print(f"valid outputs, localrun constrained: {share['constrained'] * 100:.0f}% (target 100%)")
    print(f"tool_choice required, {args.rows} requests: valid calls from localrun serve {calls['localrun'] * 100:.0f}%, "
          f"from llama-server --jinja {calls['llama-server'] * 100:.0f}%")
    print(f"token mask per step, this schema, {model.name}'s vocabulary: llguidance {llg_ms:.3f} ms, "
          f"llama.cpp grammar sampler {native_ms:.3f} ms ({native_ms / llg_ms:.0f}x)")


if __name__ == "__main__":
    main()
