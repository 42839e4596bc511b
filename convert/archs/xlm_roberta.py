"""XLM-RoBERTa encoders (llama.cpp's BERT graph): BGE-M3 embeddings and the BGE reranker
(XLMRobertaForSequenceClassification, whose classification head llama.cpp runs with rank
pooling). The vocabulary is SentencePiece Unigram (llama.cpp's "t5" tokenizer) in fairseq's
order; positions start after the padding index, so the first pad+1 position rows are dropped."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf

from convert.archs import register
from convert.archs.base import Arch, Piece, TensorSpec

if TYPE_CHECKING:
    from convert.vocab import Vocab


@register("XLMRobertaModel", "XLMRobertaForSequenceClassification")
class XLMRoberta(Arch):
    gguf_arch = gguf.MODEL_ARCH.BERT
    skip_prefixes = ("pooler.", "lm_head.")

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        pad = self.config.get("pad_token_id")
        self.offset = int(pad) + 1 if pad is not None else 0
        labels = self.config.get("id2label") or {}
        # AutoConfig's two placeholder labels mean no labels (as llama.cpp's converter reads them)
        dummy = len(labels) == 2 and labels.get("0", labels.get(0)) == "LABEL_0"
        self.labels = [] if dummy else [str(v) for _, v in sorted(labels.items(), key=lambda kv: int(kv[0]))]
        self.classifier = "XLMRobertaForSequenceClassification" in (self.config.get("architectures") or [])

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        w.add_block_count(self.n_layers)
        w.add_context_length(int(self.need("max_position_embeddings")) - self.offset)
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_head_count(int(self.need("num_attention_heads")))
        w.add_layer_norm_eps(float(self.get("layer_norm_eps", 1e-12)))
        w.add_causal_attention(False)
        if self.classifier:
            # The file says what it is: a reranker (llama.cpp's converter leaves this to
            # llama-server's --rerank; the graph is the same either way).
            w.add_pooling_type(gguf.PoolingType.RANK)
        if self.labels:
            w.add_classifier_output_labels(self.labels)

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if name.startswith("roberta."):
            name_in = name[len("roberta."):]
        else:
            name_in = name
        if name_in == "embeddings.position_ids" or self.skip(name_in):
            return []
        new = self.gguf_name(name_in)
        if name_in == "embeddings.position_embeddings.weight" and self.offset:
            rows = shape[0] - self.offset
            return [TensorSpec(new, name, (rows, *shape[1:]), pieces=(Piece(name, self.offset),))]
        return [TensorSpec(new, name, shape)]

    def load_vocab(self, folder: Path, n_vocab: int | None) -> Vocab:
        from convert.vocab import xlmr_unigram

        return xlmr_unigram(folder, n_vocab, int(self.get("type_vocab_size", 1)))
