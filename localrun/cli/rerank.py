"""`localrun rerank`: order documents by a reranker's score for a query."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from localrun.cli.options import add_load_flags, int_in, load_options_from_args
from localrun.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rerank", help="order documents by a reranker's relevance score for a query",
                       description=cmd_rerank.__doc__)
    p.add_argument("model", help="a reranker (BGE reranker, Qwen3-Reranker converted to GGUF): a name or a .gguf path")
    p.add_argument("query", help="the query the documents are scored for")
    p.add_argument("--docs", "-d", required=True, metavar="FILE",
                   help="the documents: one per line, or JSONL (a string or {\"text\": ...} per line); - reads stdin")
    p.add_argument("--top-n", "-n", type=int_in(1), metavar="N", help="print only the N best")
    p.add_argument("--json", action="store_true", help="print the results as JSON (index, relevance_score, document)")
    add_load_flags(p)
    p.set_defaults(func=cmd_rerank)


def read_documents(path: str) -> list[str]:
    """The documents of a file: one per non-empty line; a line that is JSON (a string, or an
    object with "text" or "document") is read as such."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    docs: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip()[:1] in ('{', '"'):
            try:
                value = json.loads(line)
            except ValueError:
                value = line
            if isinstance(value, dict):
                value = value.get("text", value.get("document"))
                if not isinstance(value, str):
                    raise UsageError(f"{path}:{n}: a JSON line needs a \"text\" string")
            docs.append(str(value))
        else:
            docs.append(line)
    if not docs:
        raise UsageError(f"{path} holds no documents", "write one document per line")
    return docs


def cmd_rerank(args: argparse.Namespace) -> int:
    """Score each document of --docs for QUERY with a reranker and print them best first: the
    score (the model's raw output, as llama-server's /v1/rerank reports it), the document's line
    number among the documents (from 0) and its text."""
    from localrun import api

    docs = read_documents(args.docs)
    result = api.rerank(args.model, args.query, docs, load_options_from_args(args))
    order = result.order(args.top_n)
    if args.json:
        print(json.dumps({"results": [{"index": i, "relevance_score": result.scores[i], "document": docs[i]}
                                      for i in order], "prompt_tokens": result.prompt_tokens}, indent=2))
        return 0
    width = len(str(len(docs) - 1))
    for i in order:
        one_line = " ".join(docs[i].split())
        print(f"{result.scores[i]:>10.4f}  {i:>{width}}  {one_line[:100]}{'...' if len(one_line) > 100 else ''}")
    return 0
