"""Embeddings on the llama.cpp engine: a context of its own that pools each text's tokens into
one normalised vector."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.backends.base import Embeddings
from localrun.backends.llama_loader import last_log_error
from localrun.errors import ContextOverflowError, EngineError
from localrun.store import ModelInfo


class LlamaEmbeddings:
    """The engine's embeddings, in a context of their own made on first use."""

    ll: Any
    model: Any
    model_info: ModelInfo
    n_ctx: int
    threads: int
    bos: int
    _embed_ctx: Any

    if TYPE_CHECKING:  # defined by the engine's tokens mixin
        def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
            ...

        def meta(self, key: str) -> str | None:
            ...

    def embed(self, texts: list[str]) -> Embeddings:
        """Pooled (the file's pooling, else mean) and L2-normalised vectors, one text at a time."""
        import numpy as np

        ll = self.ll
        if self._embed_ctx is None:
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.n_ctx
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = self.threads
            cparams.embeddings = True
            cparams.no_perf = True
            if self.meta(f"{self.meta('general.architecture')}.pooling_type") is None:
                cparams.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN  # a generative model: mean of its tokens
            self._embed_ctx = ll.llama_init_from_model(self.model, cparams)
            if not self._embed_ctx:
                raise EngineError(f"cannot create an embedding context for '{self.model_info.name}': "
                                  f"{last_log_error() or 'not enough memory?'}")
        ctx = self._embed_ctx
        n_embd = ll.llama_model_n_embd(self.model)
        batch = ll.llama_batch_init(self.n_ctx, 0, 1)
        vectors: list[list[float]] = []
        total = 0
        try:
            for text in texts:
                tokens = self.tokenize(text, add_special=True, parse_special=False) or [self.bos]
                if len(tokens) > self.n_ctx:
                    raise ContextOverflowError(
                        f"an input is {len(tokens)} tokens but the context holds {self.n_ctx}",
                        "use a larger --ctx or shorter inputs")
                total += len(tokens)
                ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
                for i, t in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, True
                batch.n_tokens = len(tokens)
                if ll.llama_decode(ctx, batch) != 0:
                    raise EngineError(f"llama_decode failed while embedding {last_log_error()}".strip())
                ptr = ll.llama_get_embeddings_seq(ctx, 0)
                vec = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
                norm = float(np.linalg.norm(vec))
                vectors.append((vec / norm if norm > 0 else vec).tolist())
        finally:
            ll.llama_batch_free(batch)
        return Embeddings(vectors, total)
