"""The MLX engine, through mlx-lm: MLX model folders and Hugging Face safetensors checkpoints.

Decoding runs mlx-lm's own `generate_step` (prefill in chunks, the next token computed while the
current one is handed out), so tokens/s match `mlx_lm.generate`. The chat template is rendered by
localrun's sandboxed Jinja, not by transformers. It runs inside the engine worker process.
"""

from __future__ import annotations

import importlib.util
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from localrun.backends.base import Cancel
from localrun.chat import PLAIN_STOPS, StopMatcher, render_plain, render_template
from localrun.errors import (
    BackendUnavailableError,
    BadModelFileError,
    ContextOverflowError,
    EngineError,
    UsageError,
)
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from localrun.store import ModelInfo

INSTALL_HINT = "pip install 'localrun[mlx]' (on Linux this installs mlx[cpu])"


def mlx_installed() -> bool:
    """Whether mlx (with its native core) and mlx-lm are installed, without importing them."""
    if importlib.util.find_spec("mlx_lm") is None:
        return False
    spec = importlib.util.find_spec("mlx")  # a namespace package: finding it runs no code
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any(Path(p).glob("core*")) for p in spec.submodule_search_locations)


def _import() -> tuple[Any, Any]:
    try:
        import mlx.core as mx
        import mlx_lm
    except ImportError as e:
        raise BackendUnavailableError(f"the MLX engine is not installed ({e.name} is missing)", INSTALL_HINT) from e
    return mx, mlx_lm


def device_name(mx: Any) -> str:
    """'Metal GPU (Apple M2)', 'CUDA GPU (...)' or 'CPU (...)': where MLX computes by default."""
    dev = mx.default_device()
    try:
        name = str(mx.device_info().get("device_name") or "")
    except Exception:  # noqa: BLE001 - a name is a nicety
        name = ""
    suffix = f" ({name})" if name else ""
    if dev.type == mx.gpu:
        kind = "Metal GPU" if mx.metal.is_available() else "CUDA GPU"
        return kind + suffix
    return "CPU" + suffix


def system_info() -> dict[str, Any]:
    """Versions of mlx and mlx-lm and the device MLX runs on."""
    mx, _ = _import()
    from importlib.metadata import version

    return {
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "device": device_name(mx),
        "metal": bool(mx.metal.is_available()),
    }


class MLXBackend:
    """MLX-format folders and Hugging Face safetensors checkpoints on MLX (Metal GPU or CPU)."""

    name = "mlx"
    formats = ("mlx", "safetensors")

    def available(self) -> bool:
        return mlx_installed()

    def load(self, model: ModelInfo, options: LoadOptions) -> MLXSession:
        return MLXSession(model, options)

    def system_info(self) -> dict[str, Any]:
        return system_info()


def make_sampler(mx: Any, params: GenerationParams, vocab_size: int) -> Callable[[Any], Any]:
    """Sampling in llama.cpp's order (top-k, top-p, min-p, temperature) with mlx-lm's kernels."""
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


def repeat_penalty(mx: Any, penalty: float, last_n: int, n_fed: int) -> Callable[[Any, Any], Any]:
    """llama.cpp's repetition penalty over the last `last_n` generated tokens (not the prompt).

    mlx-lm passes a processor every token fed so far; the first `n_fed` of them are the prompt.
    """

    def process(tokens: Any, logits: Any) -> Any:
        generated = tokens[n_fed:]
        if last_n > 0:
            generated = generated[-last_n:]
        if generated.size == 0:
            return logits
        picked = logits[:, generated]
        logits[:, generated] = mx.where(picked < 0, picked * penalty, picked / penalty)
        return logits

    return process


class MLXSession:
    """One model with one KV cache, generating one reply at a time; reuses the cached prompt prefix."""

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        self.mx, mlx_lm = _import()
        from mlx_lm.models.cache import make_prompt_cache

        self._make_cache = make_prompt_cache
        self.model_info = model
        path = Path(model.path)
        try:
            self.model, self.tokenizer, config = mlx_lm.load(str(path), return_config=True)
        except FileNotFoundError as e:
            raise BadModelFileError(f"cannot load model '{model.name}' ({path}): {e}",
                                    "an MLX model is a folder with config.json, *.safetensors and tokenizer files") from e
        except (ValueError, KeyError, OSError) as e:
            raise BadModelFileError(f"cannot load model '{model.name}' ({path}): {e}",
                                    "the folder may be incomplete, or of an architecture this mlx-lm does not know; "
                                    "try 'pip install -U mlx-lm'") from e
        self.config = config
        n_train = config.get("max_position_embeddings") or (config.get("text_config") or {}).get("max_position_embeddings")
        self.n_ctx = options.n_ctx or min(n_train or LoadOptions.DEFAULT_CTX, LoadOptions.DEFAULT_CTX)
        self.n_train = n_train
        self.vocab_size = int(config.get("vocab_size") or len(self.tokenizer.get_vocab()))
        self.template = self._chat_template()
        self.cache: list[Any] = self._make_cache(self.model)
        self.cached: list[int] = []  # tokens whose KV is in self.cache

    def _chat_template(self) -> str | None:
        tpl = getattr(self.tokenizer, "chat_template", None)
        if isinstance(tpl, dict):
            tpl = tpl.get("default") or next(iter(tpl.values()), None)
        return tpl if isinstance(tpl, str) and tpl.strip() else None

    def info(self) -> dict[str, Any]:
        quant = self.config.get("quantization")
        n_layers = len(getattr(self.model, "layers", []))
        return {
            "engine": "mlx",
            "n_ctx": self.n_ctx,
            "device": device_name(self.mx),
            "n_layers": n_layers,
            "offloaded": f"{n_layers}/{n_layers}" if self.mx.default_device().type == self.mx.gpu else None,
            "n_vocab": self.vocab_size,
            "chat_template": self.template is not None,
            "quantization": f"{quant['bits']}bit/g{quant['group_size']}" if isinstance(quant, dict) and "bits" in quant else None,
        }

    # -- text -> tokens -----------------------------------------------------------------------
    def _encode(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self.tokenizer
        if parse_special:
            return list(tok.encode(text, add_special_tokens=add_special))
        try:
            return list(tok.encode(text, add_special_tokens=add_special, split_special_tokens=True))
        except TypeError:  # a slow tokenizer without the option
            return list(tok.encode(text, add_special_tokens=add_special))

    def prompt_tokens(self, request: Request, system_stops: list[str]) -> list[int]:
        """Render the request (chat template or raw) and tokenize it, as the llama.cpp engine does."""
        if request.prompt is not None:
            return self._encode(request.prompt, add_special=True, parse_special=False)
        tok = self.tokenizer
        bos = tok.bos_token or ""
        if self.template:
            text = render_template(self.template, request.messages, bos_token=bos, eos_token=tok.eos_token or "")
        elif getattr(tok, "_chat_template", None) is not None:
            # A renderer shipped as Python inside mlx-lm itself (not model-provided Jinja).
            text = tok.apply_chat_template([m.to_dict() for m in request.messages], tokenize=False,
                                           add_generation_prompt=True)
        else:
            text = render_plain(request.messages)
            system_stops.extend(PLAIN_STOPS)
        # A template that writes the BOS itself must not get a second one.
        return self._encode(text, add_special=not (bos and text.startswith(bos)), parse_special=True)

    def tokenize(self, request: Request) -> list[int]:
        return self.prompt_tokens(request, [])

    def _detokenizer(self) -> Any:
        """mlx-lm's streaming detokenizer, keeping the reply's leading space as llama.cpp does.

        mlx-lm drops it because it decodes replies on their own; a continuation needs it
        ("The capital of France is" + " Paris").
        """
        detok = self.tokenizer.detokenizer  # a fresh copy
        if hasattr(detok, "trim_space"):  # SentencePiece
            detok.trim_space = False
        elif hasattr(detok, "_maybe_trim_space"):  # byte-level BPE
            detok._maybe_trim_space = lambda text: text
        return detok

    # -- generation ---------------------------------------------------------------------------
    def _reuse_prefix(self, tokens: list[int]) -> int:
        """Trim the KV cache to the longest prefix shared with `tokens`; returns its length."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        keep = 0
        limit = min(len(self.cached), len(tokens) - 1)
        while keep < limit and self.cached[keep] == tokens[keep]:
            keep += 1
        if keep == 0 or not can_trim_prompt_cache(self.cache):
            self.cache, keep = self._make_cache(self.model), 0
        else:
            trim_prompt_cache(self.cache, len(self.cached) - keep)
        self.cached = tokens[:keep]
        return keep

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Iterator[Chunk]:
        stops = list(params.stop)
        tokens = self.prompt_tokens(request, stops)
        if not tokens:
            bos = self.tokenizer.bos_token_id
            tokens = [bos if bos is not None else 0]
        if len(tokens) >= self.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx}",
                "use a larger --ctx" + (f" (the model was trained for {self.n_train})" if self.n_train else "")
                + " or a shorter prompt",
            )
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        t0 = time.perf_counter()
        keep = self._reuse_prefix(tokens)
        try:
            yield from self._generate(tokens, keep, params, stops, cancel, t0, seed)
        except Exception as e:  # the KV cache may be half-written: start the next request afresh
            self.cache, self.cached = self._make_cache(self.model), []
            if isinstance(e, EngineError):
                raise
            raise EngineError(f"MLX generation failed: {type(e).__name__}: {e}") from e

    def _generate(self, tokens: list[int], keep: int, params: GenerationParams, stops: list[str],
                  cancel: Cancel | None, t0: float, seed: int) -> Iterator[Chunk]:
        from mlx_lm.generate import generate_step, generation_stream, wired_limit

        mx = self.mx
        mx.random.seed(seed)
        fed = tokens[keep:]
        processors = []
        if params.repeat_penalty != 1.0:
            processors.append(repeat_penalty(mx, params.repeat_penalty, params.repeat_last_n, len(fed)))
        steps: Any = generate_step(
            mx.array(fed), self.model, max_tokens=-1, prompt_cache=self.cache,
            sampler=make_sampler(mx, params, self.vocab_size), logits_processors=processors,
            prefill_step_size=2048,
        )
        eos = self.tokenizer.eos_token_ids
        detok = self._detokenizer()
        matcher = StopMatcher(stops)
        budget = params.max_tokens if params.max_tokens is not None else self.n_ctx
        n_prompt, n_gen, finish = len(tokens), 0, "length"
        stopped_by_text = False
        # Each token mlx-lm hands out has already been fed to the model (its KV is in the cache).
        self.cached = list(tokens)
        t1 = None
        streams: Any = [generation_stream]
        with wired_limit(self.model, streams):
            try:
                for tok, _ in steps:
                    if t1 is None:
                        t1 = time.perf_counter()
                    self.cached.append(tok)
                    if cancel is not None and cancel.is_set():
                        finish = "cancelled"
                        break
                    if tok in eos:
                        finish = "stop"
                        break
                    n_gen += 1
                    detok.add_token(tok)
                    out, stopped_by_text = matcher.feed(detok.last_segment)
                    if out:
                        yield Chunk(text=out)
                    if stopped_by_text:
                        finish = "stop"
                        break
                    if n_gen >= budget or n_prompt + n_gen >= self.n_ctx:
                        break
            finally:
                steps.close()
        if finish != "cancelled" and not stopped_by_text:
            # The detokenizer holds back the last word; it may still contain a stop sequence.
            detok.finalize()
            out, stopped_by_text = matcher.feed(detok.last_segment)
            tail = out if stopped_by_text else out + matcher.flush()
            finish = "stop" if stopped_by_text else finish
            if tail:
                yield Chunk(text=tail)
        t2 = time.perf_counter()
        yield Chunk.final(finish, n_prompt, n_gen, t0, t1 or t2, t2, seed)

    # -- batch --------------------------------------------------------------------------------
    def batch(self, requests: list[dict[str, Any]], params: dict[str, Any],
              cancel: Cancel | None = None) -> list[dict[str, Any]]:
        """Many replies at once through mlx-lm's continuous batching (BatchGenerator).

        Takes and returns JSON-style values, so the worker can run it by name: one
        {text, finish_reason, prompt_tokens, completion_tokens} per request, in order.
        """
        from mlx_lm.generate import BatchGenerator

        gp = GenerationParams.from_dict(params)
        if gp.repeat_penalty != 1.0:
            raise UsageError("--repeat-penalty is not supported in MLX batches", "leave it at 1, or run the prompts one by one")
        reqs = [Request.from_dict(r) for r in requests]
        stops = [list(gp.stop) for _ in reqs]
        prompts = [self.prompt_tokens(r, s) or [self.tokenizer.bos_token_id or 0] for r, s in zip(reqs, stops, strict=True)]
        for p in prompts:
            if len(p) >= self.n_ctx:
                raise ContextOverflowError(f"a prompt is {len(p)} tokens but the context holds {self.n_ctx}",
                                           "use a larger --ctx or shorter prompts")
        if gp.seed is not None:
            self.mx.random.seed(gp.seed)
        budget = [min(gp.max_tokens or self.n_ctx, self.n_ctx - len(p)) for p in prompts]
        gen = BatchGenerator(self.model, stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
                             sampler=make_sampler(self.mx, gp, self.vocab_size))
        try:
            uids = gen.insert(prompts, budget)
            index = {uid: i for i, uid in enumerate(uids)}
            detoks = [self._detokenizer() for _ in prompts]
            matchers = [StopMatcher(s) for s in stops]
            texts = [""] * len(prompts)
            counts = [0] * len(prompts)
            finish: list[str | None] = [None] * len(prompts)
            while (responses := gen.next_generated()) and not (cancel is not None and cancel.is_set()):
                done = []
                for r in responses:
                    i = index[r.uid]
                    if r.finish_reason == "stop":  # an end-of-sequence token, not part of the reply
                        finish[i] = "stop"
                        continue
                    counts[i] += 1
                    detoks[i].add_token(r.token)
                    if r.finish_reason is not None:
                        detoks[i].finalize()
                    out, hit = matchers[i].feed(detoks[i].last_segment)
                    texts[i] += out
                    if hit:
                        finish[i] = "stop"
                        done.append(r.uid)
                    elif r.finish_reason is not None:
                        finish[i] = "length"
                if done:
                    gen.remove(done)
        finally:
            gen.close()
        for i, m in enumerate(matchers):
            if finish[i] != "stop":
                texts[i] += m.flush()
        return [{"text": texts[i], "finish_reason": finish[i] or "cancelled", "prompt_tokens": len(prompts[i]),
                 "completion_tokens": counts[i]} for i in range(len(prompts))]

    def close(self) -> None:
        self.cache, self.cached = [], []
        self.model = None
        self.mx.clear_cache()
