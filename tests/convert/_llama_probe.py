"""Run llama.cpp on a GGUF in a child process (a native abort must fail one test, not the run).

python _llama_probe.py REQUEST.json RESULT.npz
request: {"model": path, "tokenize": [texts], "logits": [[ids]], "top1": [[ids]],
          "generate": {"ids": [...], "n": N}, "lora": [[adapter.gguf, scale], ...]}
          (LoRA adapters applied to logits, top1 and generate; top1: the logits' argmax per position,
          taken here: a 151k-token vocabulary's logits are some 180 MB to pass back)
"""

from __future__ import annotations

import json
import sys

import numpy as np


def tokenize(llama_cpp, vocab, text: str, parse_special: bool = False) -> list[int]:  # noqa: ANN001
    data = text.encode("utf-8")
    n_max = len(data) + 16
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, False, parse_special)
    if n < 0:
        raise RuntimeError(f"tokenize failed: {n}")
    return list(buf[:n])


def set_adapters(llama_cpp, llm, loras: list) -> None:  # noqa: ANN001
    """Load GGUF LoRA adapters and apply them with their scales (llama.cpp's low-level API)."""
    import ctypes

    handles = []
    for path, _ in loras:
        handle = llama_cpp.llama_adapter_lora_init(llm._model.model, str(path).encode())
        if not handle:
            raise SystemExit(f"adapter load failed: {path}")
        handles.append(handle)  # freed with the model
    n = len(handles)
    adapters = (llama_cpp.llama_adapter_lora_p_ctypes * n)(*handles)
    scales = (ctypes.c_float * n)(*[float(scale) for _, scale in loras])
    if llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, adapters, n, scales) != 0:
        raise SystemExit("llama_set_adapters_lora failed")


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
            out[f"tok{i}"] = np.asarray(
                tokenize(llama_cpp, vocab, text, bool(req.get("parse_special"))), dtype=np.int64
            )
        out["add_bos"] = np.asarray([bool(llama_cpp.llama_vocab_get_add_bos(vocab))])
        llama_cpp.llama_model_free(model)
    if req.get("logits") or req.get("top1") or req.get("generate"):
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
        if req.get("lora"):
            set_adapters(llama_cpp, llm, req["lora"])
        for i, ids in enumerate(req.get("logits") or []):
            llm.reset()
            llm.eval(ids)
            out[f"logits{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32)
        for i, ids in enumerate(req.get("top1") or []):
            llm.reset()
            llm.eval(ids)
            out[f"top1_{i}"] = np.asarray(llm.scores[: len(ids)], dtype=np.float32).argmax(-1)
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
