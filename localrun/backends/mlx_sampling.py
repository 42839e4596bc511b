"""Sampling on MLX: the sampler in llama.cpp's order, and the logits processors (grammar, forced
tokens, penalties) that mlx-lm runs before it at each step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from localrun.backends.grammar import GrammarState
from localrun.settings import GenerationParams


def make_sampler(mx: Any, params: GenerationParams, vocab_size: int) -> Callable[[Any], Any]:
    """Sampling in llama.cpp's order (top-k, typical, top-p, min-p, temperature) with mlx-lm's kernels."""
    from mlx_lm.sample_utils import (
        apply_min_p,
        apply_top_k,
        apply_top_p,
        categorical_sampling,
        greedy_sampler,
    )

    if params.temperature <= 0:
        return greedy_sampler
    steps: list[Callable[[Any], Any]] = []
    if 0 < params.top_k < vocab_size:
        steps.append(lambda x: apply_top_k(x, params.top_k))
    if params.typical_p < 1.0:
        steps.append(lambda x: apply_typical(mx, x, params.typical_p))
    if params.top_p < 1.0:
        steps.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0.0:
        steps.append(lambda x: apply_min_p(x, params.min_p))
    temp = params.temperature

    def sample(logprobs: Any) -> Any:
        for step in steps:
            logprobs = step(logprobs)
        return categorical_sampling(logprobs, temp)

    return sample


def apply_typical(mx: Any, logprobs: Any, p: float) -> Any:
    """Locally typical sampling as llama.cpp's typical sampler does it: the tokens whose surprise is
    closest to the distribution's entropy, in that order, until their probability passes p (that
    token kept, and at least one)."""
    lp = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    probs = mx.exp(lp)
    entropy = -mx.sum(mx.where(probs > 0, probs * lp, 0.0), axis=-1, keepdims=True)
    order = mx.argsort(mx.abs(-lp - entropy), axis=-1)  # tokens already cut (-inf) come last
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    keep_sorted = (mx.cumsum(sorted_probs, axis=-1) - sorted_probs) <= p
    keep = mx.put_along_axis(mx.zeros(lp.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, -float("inf"))


def biasing(mx: Any, bias: tuple[tuple[int, float], ...]) -> Callable[[Any, Any], Any]:
    """A logits processor that adds each (token, bias) to that token's logit; first in the chain,
    as llama.cpp's logit-bias sampler."""
    import numpy as np

    vector: list[Any] = []

    def process(tokens: Any, logits: Any) -> Any:
        if not vector:  # the logits' width (a padded vocabulary) is known at the first call
            dense = np.zeros(logits.shape[-1], dtype=np.float32)
            for t, b in bias:
                if t < dense.shape[0]:
                    dense[t] = b
            vector.append(mx.array(dense))
        return logits + vector[0].astype(logits.dtype)

    return process


def constrain(mx: Any, grammar: GrammarState, n_fed: int) -> Callable[[Any, Any], Any]:
    """A logits processor that applies a sequence's grammar: it advances the matcher over the
    tokens generated since its last call, then masks what the grammar forbids."""
    import numpy as np

    def process(tokens: Any, logits: Any) -> Any:
        generated = tokens[n_fed:]
        for t in np.array(generated[grammar.consumed:]).tolist():
            grammar.accept(int(t))
        if not grammar.active:
            return logits
        allowed = grammar.allowed(lambda: np.array(logits[0].astype(mx.float32)))
        vocab = logits.shape[-1]
        if allowed.shape[0] < vocab:
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.shape[0], dtype=bool)])
        return mx.where(mx.array(allowed[:vocab])[None], logits, -float("inf"))

    return process


def forcing(mx: Any, queue: list[int]) -> Callable[[Any, Any], Any]:
    """A logits processor that leaves only the next queued token possible while the queue (a
    thinking budget's closing marker, filled by Engine.force) has any; last in the chain."""

    def process(tokens: Any, logits: Any) -> Any:
        if not queue:
            return logits
        keep = queue.pop(0)
        ids = mx.arange(logits.shape[-1])[None]
        return mx.where(ids == keep, mx.zeros_like(logits), mx.full(logits.shape, -float("inf"), logits.dtype))

    return process


def penalties(mx: Any, params: GenerationParams, n_fed: int) -> Callable[[Any, Any], Any]:
    """llama.cpp's repetition, frequency and presence penalties over the last `repeat_last_n`
    generated tokens (not the prompt).

    mlx-lm passes a processor every token fed so far; the first `n_fed` of them are the prompt.
    """
    import numpy as np

    penalty, last_n = params.repeat_penalty, params.repeat_last_n
    freq, present = params.frequency_penalty, params.presence_penalty

    def process(tokens: Any, logits: Any) -> Any:
        generated = tokens[n_fed:]
        if last_n > 0:
            generated = generated[-last_n:]
        if generated.size == 0:
            return logits
        ids, counts = np.unique(np.array(generated), return_counts=True)
        idx = mx.array(ids)
        picked = logits[:, idx]
        if penalty != 1.0:
            picked = mx.where(picked < 0, picked * penalty, picked / penalty)
        picked = picked - mx.array(counts.astype(np.float32)) * freq - present
        logits[:, idx] = picked
        return logits

    return process
