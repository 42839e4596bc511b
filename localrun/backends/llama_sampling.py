"""Sampling on the llama.cpp engine: a request's native sampler chain, and a sampled token's
log-probability with the most likely alternatives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from localrun.backends.base import token_logprob
from localrun.generation import TokenLogprob
from localrun.settings import GenerationParams


class LlamaSampling:
    """The engine's samplers: one llama.cpp sampler chain per sequence, and log-probabilities."""

    ll: Any
    ctx: Any
    n_vocab: int

    if TYPE_CHECKING:  # defined by the engine's tokens mixin
        def piece(self, token: int, special: bool = False) -> bytes:
            ...

    def _logprob(self, idx: int, token: int, top: int) -> TokenLogprob:
        import numpy as np

        ptr = self.ll.llama_get_logits_ith(self.ctx, idx)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        m = logits.max()
        return token_logprob(logits - m - np.log(np.exp(logits - m).sum()), token, top,
                             lambda t: self.piece(t, special=True))

    def sample(self, sampler: Any, idx: int) -> int:
        """The token a sequence's sampler picks from the logits at batch index idx. Without a
        chain (greedy alone, see make_sampler) that is the first highest logit, as llama.cpp's
        greedy sampler picks it; numpy finds it without the candidate array llama_sampler_sample
        builds at every call (152k vocabulary: 0.018 ms against 0.17 ms, per sequence and token)."""
        if sampler is None:
            import numpy as np

            logits = np.ctypeslib.as_array(self.ll.llama_get_logits_ith(self.ctx, idx), shape=(self.n_vocab,))
            return int(logits.argmax())
        return int(self.ll.llama_sampler_sample(sampler, self.ctx, idx))

    def make_sampler(self, params: GenerationParams, seed: int) -> Any:
        """The request's llama.cpp sampler chain in llama.cpp's order (logit bias, penalties, top-k,
        typical, top-p, min-p, temperature); None for greedy decoding without penalties or biases,
        whose token sample() takes itself (free a chain with llama_sampler_free)."""
        if params.temperature <= 0 and not params.penalized and not params.logit_bias:
            return None
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.logit_bias:  # first, as llama.cpp's own chain has it
            bias = (ll.llama_logit_bias * len(params.logit_bias))(*((t, b) for t, b in params.logit_bias))
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_logit_bias(self.n_vocab, len(bias), bias))
        if params.penalized:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                self.n_vocab, params.repeat_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty))
        if params.temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
        if params.typical_p < 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_typical(params.typical_p, 1))
        if params.top_p < 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        return chain
