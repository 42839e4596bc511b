"""Qwen3 (dense): Qwen2 without biases, with per-head Q/K RMS norms; and Qwen3-Reranker, the same
network read as a reranker (llama.cpp's rank pooling: the last token's "yes" and "no" logits,
softmaxed, whose first value is the score)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf

from convert.archs import register
from convert.archs.base import Arch, Piece, TensorSpec
from convert.errors import ConvertError

# llama.cpp's rerank template for Qwen3-Reranker: the model card's prompt with its default
# instruction, {query} and {document} filled per pair (llama-server reads the same key).
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the "
    "query\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def is_qwen3_reranker(folder: Path, config: dict) -> bool:
    """Qwen3-Reranker ships as a plain Qwen3ForCausalLM: known by its model card's title or its
    name (the folder's, or the config's _name_or_path), as llama.cpp's converter knows it."""
    readme = folder / "README.md"
    try:
        text = readme.read_text(encoding="utf-8").lower() if readme.is_file() else ""
    except OSError:
        text = ""
    if "# qwen3-reranker" in text:
        return True
    hints = (folder.resolve().name, str(config.get("_name_or_path") or ""))
    return any("qwen3-reranker" in h.lower() for h in hints)


def token_id(folder: Path, text: str) -> int:
    """The id of one token of tokenizer.json's vocabulary (or its added tokens)."""
    try:
        tj = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConvertError(f"cannot read {folder / 'tokenizer.json'}: {e}",
                           "a reranker needs its tokenizer to find its yes/no tokens") from None
    vocab = (tj.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, dict) and text in vocab:
        return int(vocab[text])
    for t in tj.get("added_tokens") or ():
        if isinstance(t, dict) and t.get("content") == text:
            return int(t["id"])
    raise ConvertError(f"the reranker's tokenizer has no token {text!r}", "the tokenizer does not belong to it")


@register("Qwen3ForCausalLM")
class Qwen3(Arch):
    gguf_arch = gguf.MODEL_ARCH.QWEN3
    rerank: tuple[int, int] | None = None  # the "yes" and "no" ids of a reranker

    def read_folder(self, folder: Path) -> None:
        if is_qwen3_reranker(folder, self.config):
            self.rerank = (token_id(folder, "yes"), token_id(folder, "no"))

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if self.rerank:
            w.add_pooling_type(gguf.PoolingType.RANK)
            w.add_classifier_output_labels(["yes", "no"])
            w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if not self.rerank or name not in ("lm_head.weight", "model.embed_tokens.weight"):
            return super().specs(name, shape)
        head = self._head(name, shape)
        if name == "lm_head.weight":
            return [head]  # the output matrix gives way to the head (llama.cpp drops it too)
        tied = bool(self.config.get("tie_word_embeddings"))  # the head's rows are the embeddings'
        return super().specs(name, shape) + ([head] if tied else [])

    def _head(self, source: str, shape: tuple[int, ...]) -> TensorSpec:
        assert self.rerank is not None
        yes, no = self.rerank
        name = self.tensor_name(gguf.MODEL_TENSOR.CLS_OUT)
        return TensorSpec(name, source, (2, shape[-1]), pieces=(Piece(source, yes, yes + 1), Piece(source, no, no + 1)))
