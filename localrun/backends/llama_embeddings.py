"""Embeddings on the llama.cpp engine: a context of its own that pools each text's tokens into
one normalised vector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.backends.base import EMBEDDING_ARCHS, Embeddings, Ranked
from localrun.backends.llama_loader import last_log_error
from localrun.errors import ContextOverflowError, EngineError, UsageError
from localrun.store import ModelInfo


class LlamaEmbeddings:
    """The engine's embeddings, in a context of their own made on first use."""

    ll: Any
    model: Any
    vocab: Any
    n_vocab: int
    model_info: ModelInfo
    n_ctx: int
    threads: int
    bos: int
    _embed_ctx: Any
    _embed_size: int = 0
    _ranks: bool | None = None  # the model is a reranker (_rank_pooling)

    if TYPE_CHECKING:  # defined by the engine's tokens mixin
        def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
            ...

        def meta(self, key: str) -> str | None:
            ...

    def embed(self, texts: list[str | list[int]]) -> Embeddings:
        """Pooled (the file's pooling, else mean) and L2-normalised vectors, one per input: a text,
        or a list of token ids taken as they are (OpenAI's and llama-server's token arrays)."""
        import numpy as np

        if self._rank_pooling():
            raise UsageError(f"'{self.model_info.name}' is a reranker: it scores (query, document) pairs "
                             "and gives no embeddings", "use /v1/rerank or 'localrun rerank'")
        inputs = [self._ids(t) if isinstance(t, list) else
                  (self.tokenize(t, add_special=True, parse_special=False) or [self.bos]) for t in texts]
        vectors: list[list[float]] = []
        for vec in self._pooled(inputs):
            v = vec.astype(np.float64)
            norm = float(np.linalg.norm(v))
            vectors.append((v / norm if norm > 0 else v).tolist())
        return Embeddings(vectors, sum(len(t) for t in inputs))

    def rerank(self, query: str, documents: list[str]) -> Ranked:
        """The model's raw score of each document for the query, in the order given: the first
        value its classification head gives for the pair, as llama-server reports it (a BERT-style
        cross-encoder's logit; a Qwen3 reranker's probability of "yes"). The pair is written as
        llama-server writes it: through the file's `rerank` template when it has one, else
        [BOS] query [EOS] [SEP] document [EOS] by the vocabulary's own flags."""
        if not self._rank_pooling():
            raise UsageError(f"'{self.model_info.name}' is not a reranker (its file declares no rank pooling)",
                             "use a reranker converted to GGUF (BGE reranker, Qwen3-Reranker)")
        pairs = [self._pair(query, doc) for doc in documents]
        scores = [float(vec[0]) for vec in self._pooled(pairs)]
        return Ranked(scores, sum(len(p) for p in pairs))

    def _rank_pooling(self) -> bool:
        """A reranker: its file declares rank pooling, or (a file made by llama.cpp's converter,
        which leaves that to llama-server's --rerank) an encoder with a classification head.
        Read from the file once."""
        if self._ranks is None:
            arch = self.meta("general.architecture") or ""
            value = self.meta(f"{arch}.pooling_type")
            if value is not None:
                self._ranks = int(value) == int(self.ll.LLAMA_POOLING_TYPE_RANK)
            else:
                self._ranks = arch in EMBEDDING_ARCHS and bool(self.ll.llama_model_cls_label(self.model, 0))
        return self._ranks

    def _ids(self, tokens: list[int]) -> list[int]:
        n_vocab = self.n_vocab
        bad = next((t for t in tokens if not 0 <= int(t) < n_vocab), None)
        if bad is not None:
            raise UsageError(f"token id {bad} is outside the vocabulary of '{self.model_info.name}' "
                             f"(0..{n_vocab - 1})", "send token ids the model's tokenizer made")
        if not tokens:
            raise UsageError("an input is an empty list of tokens", "send at least one token id")
        return [int(t) for t in tokens]

    def _pair(self, query: str, doc: str) -> list[int]:
        ll = self.ll
        template = self.meta("tokenizer.chat_template.rerank")
        if template:
            text = template.replace("{query}", query).replace("{document}", doc)
            return self.tokenize(text, add_special=False, parse_special=True)
        vocab = self.vocab
        eos = ll.llama_vocab_eos(vocab)
        if eos == ll.LLAMA_TOKEN_NULL:
            eos = ll.llama_vocab_sep(vocab)
        out: list[int] = [ll.llama_vocab_bos(vocab)] if ll.llama_vocab_get_add_bos(vocab) else []
        out += self.tokenize(query, add_special=False, parse_special=False)
        if ll.llama_vocab_get_add_eos(vocab):
            out.append(eos)
        if ll.llama_vocab_get_add_sep(vocab):
            out.append(ll.llama_vocab_sep(vocab))
        out += self.tokenize(doc, add_special=False, parse_special=False)
        if ll.llama_vocab_get_add_eos(vocab):
            out.append(eos)
        return out

    def _context(self, longest: int) -> Any:
        """The embedding context, sized to the longest input seen so far (a power of two from 512,
        within the model's context): one ubatch holds a whole input, which an encoder needs, and a
        model with a long context is not given a compute buffer for it that no input uses."""
        ll = self.ll
        size = min(self.n_ctx, max(512, 1 << (max(longest, 1) - 1).bit_length()))
        if self._embed_ctx is not None and self._embed_size < size:
            ll.llama_free(self._embed_ctx)
            self._embed_ctx = None
        if self._embed_ctx is None:
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = size
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = self.threads
            cparams.embeddings = True
            cparams.no_perf = True
            if self._rank_pooling():
                cparams.pooling_type = ll.LLAMA_POOLING_TYPE_RANK
            elif self.meta(f"{self.meta('general.architecture')}.pooling_type") is None:
                cparams.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN  # a generative model: mean of its tokens
            self._embed_ctx = ll.llama_init_from_model(self.model, cparams)
            if not self._embed_ctx:
                raise EngineError(f"cannot create an embedding context for '{self.model_info.name}': "
                                  f"{last_log_error() or 'not enough memory?'}")
            self._embed_size = size
        return self._embed_ctx

    def _pooled(self, inputs: list[list[int]]) -> list[Any]:
        """The pooled output of each token list, one sequence at a time (a float32 array: the
        embedding, or a reranker's classification outputs)."""
        import numpy as np

        ll = self.ll
        rank = self._rank_pooling()
        width = int(ll.llama_model_n_cls_out(self.model)) if rank else int(ll.llama_model_n_embd(self.model))
        for tokens in inputs:
            if len(tokens) > self.n_ctx:
                raise ContextOverflowError(
                    f"an input is {len(tokens)} tokens but the context holds {self.n_ctx}",
                    "use a larger --ctx or shorter inputs")
        longest = max((len(t) for t in inputs), default=1)
        ctx = self._context(longest)
        batch = ll.llama_batch_init(longest, 0, 1)
        out: list[Any] = []
        try:
            for tokens in inputs:
                ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
                for i, t in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, True
                batch.n_tokens = len(tokens)
                if ll.llama_decode(ctx, batch) != 0:
                    raise EngineError(f"llama_decode failed while embedding {last_log_error()}".strip())
                ptr = ll.llama_get_embeddings_seq(ctx, 0)
                out.append(np.ctypeslib.as_array(ptr, shape=(width,)).copy())
        finally:
            ll.llama_batch_free(batch)
        return out
