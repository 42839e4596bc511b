"""Run llama.cpp on a GGUF in a child process (a native abort must fail one test, not the run).

python _llama_probe.py REQUEST.json RESULT.npz
request: {"model": path, "tokenize": [texts], "logits": [[ids]], "generate": {"ids": [...], "n": N}}
"""

from __future__ import annotations

import json
import sys

import numpy as np


def tokenize(llama_cpp, vocab, text: str) -> list[int]:  # noqa: ANN001
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, False, False)
    if n < 0:
        raise RuntimeError(f"tokenize failed: {n}")
    return list(buf[:n])


def main() -> None:
    req = json.load(open(sys.argv[1]))
    import llama_cpp

    out: dict[str, np.ndarray] = {}
    if req.get("tokenize"):
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = llama_cpp.llama_model_load_from_file(req["model"].encode(), params)
        if not model:
            raise SystemExit("load failed")
        vocab = llama_cpp.llama_model_get_vocab(model)
        for i, text in enumerate(req["tokenize"]):
            out[f"tok{i}"] = np.asarray(tokenize(llama_cpp, vocab, text), dtype=np.int64)
        llama_cpp.llama_model_free(model)
    if req.get("logits") or req.get("generate"):
        llm = llama_cpp.Llama(
            req["model"],
            n_ctx=req.get("n_ctx", 512),
            logits_all=True,
            verbose=False,
            n_threads=2,
            n_batch=512,
            seed=0,
            type_k=0,
            type_v=0,
        )  # F32 KV cache: compare the weights, not the cache
        for i, ids in enumerate(req.get("logits") or []):
            llm.reset()
            llm.eval(ids)
            out[f"logits{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        if gen := req.get("generate"):
            llm.reset()
            ids = list(gen["ids"])
            res = []
            for _ in range(gen["n"]):
                llm.eval(ids[-1:] if res else ids)
                nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                res.append(nxt)
                ids.append(nxt)
            out["generated"] = np.asarray(res, dtype=np.int64)
    np.savez(sys.argv[2], **out)


if __name__ == "__main__":
    main()
