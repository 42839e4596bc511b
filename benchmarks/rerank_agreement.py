"""Agreement: a reranker's scores through localrun's /v1/rerank, llama.cpp's llama-server --rerank
on the same file, and transformers on the checkpoint the file was converted from.

Both families the tests build (tests/convert/test_convert_rerank.py): a tiny BGE reranker
(XLM-RoBERTa with a classification head) and a tiny Qwen3-Reranker, converted by localrun to F32.
transformers scores each pair as the model's own code does (the cross-encoder's logit; the
Qwen3-Reranker card's yes/no softmax); localrun serve and llama-server answer the same
/v1/rerank request. Prints, per family, each document's three scores, the largest differences and
whether the orders agree; --json writes them.

    .venv/bin/python benchmarks/rerank_agreement.py [--json FILE] [--work DIR]

llama-server is built from the llama.cpp that llama-cpp-python vendors by benchmarks/llama_tools.py
(cached outside the repository).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "convert"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from llama_tools import tool_binary  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> Any:
    import httpx

    res = httpx.post(url, json=body, timeout=300)
    res.raise_for_status()
    return res.json()


def wait_health(url: str, proc: subprocess.Popen) -> None:
    import httpx

    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def scores(url: str, model: str, query: str, docs: list[str]) -> list[float]:
    out = [0.0] * len(docs)
    for r in post(f"{url}/v1/rerank", {"model": model, "query": query, "documents": docs})["results"]:
        out[r["index"]] = float(r["relevance_score"])
    return out


def serve(cmd: list[str], url: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    wait_health(url, proc)
    return proc


def build(work: Path) -> dict[str, tuple[Path, list[float]]]:
    """Each family's F32 GGUF and transformers' scores of the documents."""
    import test_convert_rerank as t
    from convert_helpers import make_checkpoint

    import convert

    out = {}
    bge = work / "bge-reranker-tiny"
    model, tok = t.make_bge_reranker(bge)
    out["bge-reranker (xlm-roberta)"] = (convert.convert(bge, work / "bge.gguf", outtype="f32", force=True).path,
                                         t.cross_encoder_scores(model, tok))
    qwen = work / "Qwen3-Reranker-tiny"
    qwen.mkdir(exist_ok=True)
    model, tok = make_checkpoint(qwen, "qwen3", config=t.PUBLISHED, seed=3)
    out["qwen3-reranker"] = (convert.convert(qwen, work / "qwen3.gguf", outtype="f32", force=True).path,
                             t.card_scores(model, tok))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--work", metavar="DIR")
    args = ap.parse_args()
    import test_convert_rerank as t

    server = tool_binary("llama-server")
    work = Path(args.work or tempfile.mkdtemp(prefix="rerank-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "home"
    env = {**os.environ, "LOCALRUN_HOME": str(home)}
    report: dict[str, Any] = {}
    for family, (path, want) in build(work).items():
        subprocess.run([sys.executable, "-m", "localrun", "add", str(path), "--name", "rr:f32", "--force"],
                       env=env, check=True, capture_output=True)
        lr_port, ls_port = free_port(), free_port()
        lr_url, ls_url = f"http://127.0.0.1:{lr_port}", f"http://127.0.0.1:{ls_port}"
        procs = [serve([sys.executable, "-m", "localrun", "serve", "--port", str(lr_port), "--ctx", "512"], lr_url, env,
                       work / "localrun.log"),
                 serve([str(server), "-m", str(path), "--rerank", "--port", str(ls_port), "-c", "512", "-t", "2"],
                       ls_url, env, work / "llama-server.log")]
        try:
            lr = scores(lr_url, "rr:f32", t.QUERY, t.DOCS)
            ls = scores(ls_url, "rr", t.QUERY, t.DOCS)
        finally:
            for p in procs:
                p.terminate()
                p.wait(30)

        def order(xs: list[float]) -> list[int]:
            return sorted(range(len(xs)), key=lambda i: -xs[i])

        report[family] = {
            "documents": t.DOCS, "transformers": want, "localrun": lr, "llama-server": ls,
            "max |localrun - llama-server|": max(abs(a - b) for a, b in zip(lr, ls, strict=True)),
            "max |localrun - transformers|": max(abs(a - b) for a, b in zip(lr, want, strict=True)),
            "same order (all three)": order(lr) == order(ls) == order(want),
        }
        print(f"\n{family} (query: {t.QUERY!r})")
        print(f"{'document':<52} {'transformers':>13} {'localrun':>11} {'llama-server':>13}")
        for doc, a, b, c in zip(t.DOCS, want, lr, ls, strict=True):
            print(f"{doc[:50]:<52} {a:>13.6f} {b:>11.6f} {c:>13.6f}")
        r = report[family]
        print(f"max |localrun - llama-server| = {r['max |localrun - llama-server|']:.2e}; "
              f"max |localrun - transformers| = {r['max |localrun - transformers|']:.2e}; "
              f"same order: {r['same order (all three)']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
