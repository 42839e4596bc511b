"""Values that cross module and process boundaries: requests, settings, streamed chunks."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from localrun.chat import Message, parse_messages
from localrun.errors import UsageError

THINK_EFFORTS = ("low", "medium", "high")
DRAFTERS = ("lookup", "model")  # speculative decoding's drafters: prompt lookup, the loaded draft model
# The KV-cache types a model loads with (--kv-type): llama.cpp's cache types; q8_0 and q4_0 store
# 8.5 and 4.5 bits per value, and need flash attention for the V cache.
KV_TYPES = ("f16", "q8_0", "q4_0")


def _adapters(value: Any) -> tuple[tuple[str, float], ...]:
    """(path, scale) pairs as a tuple of tuples (JSON brings them back as lists)."""
    out = []
    for item in value or ():
        path, scale = item
        scale = float(scale)
        _check(math.isfinite(scale), "--lora", f"{path}:{scale}", "a finite scale, e.g. ADAPTER:0.5")
        out.append((str(path), scale))
    return tuple(out)


def _finite(value: float) -> bool:
    """math.isfinite, false for an int too large for a float (JSON allows any number of digits)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check(cond: bool, flag: str, value: Any, expected: str) -> None:
    if not cond:
        raise UsageError(f"invalid value for {flag}: {value!r}", f"expected {expected}")


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping settings for one reply."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; N: the chosen token's logprob and the N most likely
    grammar: str | None = None  # a Lark grammar (llguidance) the output must match: see constraint.py
    grammar_trigger: str | None = None  # the grammar applies from this text on (a lazy grammar), else from the start
    special: bool = False  # render control tokens as text (tool-call openers such as [TOOL_CALLS])
    # GGUF LoRA adapters applied to this reply, as (adapter file, scale); the base model stays loaded
    lora: tuple[tuple[str, float], ...] = ()
    # A thinking model's thought ends after this many tokens: the loop inserts the format's closing marker
    think_budget: int | None = None
    # Speculative decoding: "lookup" drafts from the prompt and the reply so far, "model" with the
    # draft model loaded beside the model (LoadOptions.draft); None: off. Each step drafts up to
    # draft_max tokens, and none when fewer than draft_min would fit
    speculative: str | None = None
    draft_max: int = 8
    draft_min: int = 1
    draft_always: bool = False  # draft even where the measured costs say drafting does not pay

    def __post_init__(self) -> None:
        _check(_finite(self.temperature) and self.temperature >= 0, "--temperature", self.temperature, "a number >= 0")
        _check(0 < self.top_p <= 1, "--top-p", self.top_p, "a number in (0, 1]")
        _check(self.top_k >= 0, "--top-k", self.top_k, "an integer >= 0 (0 disables it)")
        _check(0 <= self.min_p <= 1, "--min-p", self.min_p, "a number in [0, 1]")
        _check(_finite(self.repeat_penalty) and self.repeat_penalty > 0, "--repeat-penalty", self.repeat_penalty, "a number > 0 (1 disables it)")
        _check(self.repeat_last_n >= 0, "--repeat-last-n", self.repeat_last_n, "an integer >= 0")
        _check(self.seed is None or 0 <= self.seed < 2**32, "--seed", self.seed, "an integer in [0, 2^32)")
        _check(self.max_tokens is None or self.max_tokens > 0, "--max-tokens", self.max_tokens, "an integer > 0")
        _check(_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "a number in [-2, 2]")
        _check(_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "a number in [-2, 2]")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "an integer in [0, 20]")
        _check(self.grammar_trigger is None or (self.grammar is not None and self.grammar_trigger != ""),
               "grammar_trigger", self.grammar_trigger, "a non-empty text, with a grammar")
        _check(self.think_budget is None or (isinstance(self.think_budget, int) and self.think_budget >= 0),
               "--think-budget", self.think_budget, "an integer >= 0 (tokens of thought)")
        _check(self.speculative in (None, *DRAFTERS), "--draft", self.speculative,
               f"one of {', '.join(DRAFTERS)}")
        _check(isinstance(self.draft_max, int) and 1 <= self.draft_max <= 64, "--draft-max", self.draft_max,
               "an integer in [1, 64]")
        _check(isinstance(self.draft_min, int) and 1 <= self.draft_min <= self.draft_max, "--draft-min",
               self.draft_min, f"an integer in [1, --draft-max ({self.draft_max})]")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "lora", _adapters(self.lora))

    def budget(self, n_ctx: int, n_prompt: int) -> int:
        """How many tokens the reply may have: max_tokens, within what the context has left."""
        return min(self.max_tokens or n_ctx, n_ctx - n_prompt)

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty applies."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def layered(cls, defaults: dict[str, Any] | None, values: dict[str, Any]) -> GenerationParams:
        """The settings a request gives (values) over a preset's (defaults) over localrun's own; an
        empty stop list counts as not given."""
        given = {k: v for k, v in values.items() if not (k == "stop" and not v)}
        return cls(**{**(defaults or {}), **given})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationParams:
        """Build from a JSON-style dict; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise UsageError(f"unknown generation setting(s): {', '.join(unknown)}", f"known: {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_threads() -> int:
    """Threads for decoding: every core up to 4, then half of them (hyper-threads do not help)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return n if n <= 4 else max(4, n // 2)


@dataclass(frozen=True)
class LoadOptions:
    """How an engine loads a model."""

    n_ctx: int | None = None  # tokens per sequence; None: the model's trained context if memory holds it (fit.context_for)
    n_threads: int | None = None
    gpu_layers: int | str = "auto"  # "auto": all layers that fit; 0: CPU only
    flash_attn: bool | None = None  # None: the engine decides
    n_batch: int = 512
    n_parallel: int = 1
    max_queue: int = 0  # requests waiting beyond n_parallel; 0: unbounded
    # LoRA adapters applied when the model loads, as (PEFT adapter folder, scale): the MLX engine's
    # way (llama.cpp applies GGUF adapters per request instead: GenerationParams.lora).
    lora: tuple[tuple[str, float], ...] = ()
    # Mixture-of-experts models: the expert tensors of the first N layers ("all": every layer) stay
    # in host memory, as llama.cpp's --n-cpu-moe / --cpu-moe do; 0: placed like the other tensors.
    cpu_moe: int | str = 0
    kv_type: str = "f16"  # the KV cache's type: one of KV_TYPES
    # Speculative decoding's draft model (a GGUF file with the model's vocabulary), loaded beside it;
    # a draft whose vocabulary does not match is refused, or with draft_optional dropped with a note
    draft: str | None = None
    draft_optional: bool = False
    # A vision model's projector (mmproj GGUF) when it is not recorded with the model in the store
    mmproj: str | None = None

    def __post_init__(self) -> None:
        _check(self.n_ctx is None or 16 <= self.n_ctx <= 1 << 22, "--ctx", self.n_ctx, "an integer of at least 16")
        _check(self.kv_type in KV_TYPES, "--kv-type", self.kv_type, " or ".join(KV_TYPES))
        if self.kv_type != "f16" and self.flash_attn is False:
            raise UsageError(f"--kv-type {self.kv_type} needs flash attention, and --flash-attn is off",
                             "drop --flash-attn off (flash attention then turns on for a quantized cache), "
                             "or keep the f16 cache")
        _check(self.n_threads is None or 1 <= self.n_threads <= 1024, "--threads", self.n_threads, "an integer >= 1")
        g = self.gpu_layers
        _check(g == "auto" or (isinstance(g, int) and g >= -1), "--gpu-layers", g, "'auto' or an integer >= 0")
        _check(self.n_batch >= 1, "--batch-size", self.n_batch, "an integer >= 1")
        _check(self.n_parallel >= 1, "--parallel", self.n_parallel, "an integer >= 1")
        _check(self.max_queue >= 0, "--max-queue", self.max_queue, "an integer >= 0")
        m = self.cpu_moe
        _check(m == "all" or (isinstance(m, int) and not isinstance(m, bool) and m >= 0), "--cpu-moe", m,
               "'all' or a number of layers >= 0")
        object.__setattr__(self, "lora", _adapters(self.lora))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    """What to generate from: chat messages (templated) or a raw prompt."""

    messages: tuple[Message, ...] = ()
    prompt: str | None = None
    tools: tuple[dict[str, Any], ...] = field(default=(), hash=False)  # rendered by the chat template
    # Thinking on (True), off (False), at an effort ("low", "medium", "high"), or as the template's default (None)
    think: bool | str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict, hash=False)  # a client's chat_template_kwargs
    template: str | None = None  # a Jinja chat template used instead of the model's own (a preset's TEMPLATE)

    @property
    def images(self) -> int:
        """How many images the messages carry."""
        return sum(len(m.images) for m in self.messages)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise UsageError("a request needs either messages or a raw prompt")
        if self.tools and self.prompt is not None:
            raise UsageError("tools need chat messages, not a raw prompt")
        _check(self.think in (None, True, False, *THINK_EFFORTS), "think", self.think,
               f"true, false or an effort ({', '.join(THINK_EFFORTS)})")
        object.__setattr__(self, "template_kwargs", dict(self.template_kwargs or {}))

    @classmethod
    def chat(cls, messages: Any, tools: Any = (), think: bool | str | None = None,
             template_kwargs: dict[str, Any] | None = None) -> Request:
        return cls(messages=tuple(parse_messages(messages)), tools=tuple(tools or ()), think=think,
                   template_kwargs=dict(template_kwargs or {}))

    @classmethod
    def raw(cls, prompt: str, system: str | None = None) -> Request:
        """Plain-text completion; a system prompt, if any, goes before it as a paragraph."""
        return cls(prompt=f"{system}\n\n{prompt}" if system else prompt)

    def template_extras(self) -> dict[str, Any]:
        """What the chat template gets beyond the messages: the tools, when there are any."""
        return {"tools": [dict(t) for t in self.tools]} if self.tools else {}

    def to_dict(self) -> dict[str, Any]:
        from localrun.images import to_base64

        messages = [m.to_dict() | ({"images": [to_base64(b) for b in m.images]} if m.images else {})
                    for m in self.messages]
        return {"messages": messages, "prompt": self.prompt, "tools": list(self.tools),
                "think": self.think, "template_kwargs": dict(self.template_kwargs), "template": self.template}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Request:
        if data.get("prompt") is not None:
            return cls(prompt=data["prompt"], think=data.get("think"))
        req = cls.chat(data["messages"], data.get("tools") or (), data.get("think"), data.get("template_kwargs"))
        return replace(req, template=data["template"]) if data.get("template") else req


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, with the most likely alternatives at its position."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple[TokenLogprob, ...] = ()

    def to_list(self) -> list[Any]:
        """A compact JSON form: [token, logprob, bytes, [[token, logprob, bytes], ...]]."""
        return [self.token, self.logprob, list(self.bytes), [[t.token, t.logprob, list(t.bytes)] for t in self.top]]

    @classmethod
    def from_list(cls, data: list[Any]) -> TokenLogprob:
        return cls(data[0], data[1], tuple(data[2]), tuple(cls(t[0], t[1], tuple(t[2])) for t in data[3]))


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed output; the last one has done=True and the statistics."""

    text: str = ""
    done: bool = False
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_ms: float = 0.0
    decode_ms: float = 0.0
    seed: int | None = None
    cached_tokens: int = 0  # prompt tokens found in the KV cache (not evaluated again)
    thinking: str = ""  # a thinking model's thought, kept apart from the answer (text)
    thinking_tokens: int = 0  # on the last chunk: tokens generated inside the thought
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens whose text is in this chunk
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    drafted_tokens: int = 0  # on the last chunk: tokens speculative decoding drafted for the reply
    accepted_tokens: int = 0  # of those, the ones the model kept
    images_encoded: int = 0  # on the last chunk: images the prompt's evaluation encoded (cached ones are not)

    @classmethod
    def final(cls, finish_reason: str, prompt_tokens: int, completion_tokens: int, t_start: float,
              t_prompt_done: float, t_end: float, seed: int | None, cached_tokens: int = 0) -> Chunk:
        """The last chunk of a reply, from perf_counter() stamps at its start, after the prompt, at its end."""
        return cls(done=True, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
                   completion_tokens=completion_tokens, prompt_ms=(t_prompt_done - t_start) * 1000,
                   decode_ms=(t_end - t_prompt_done) * 1000, seed=seed, cached_tokens=cached_tokens)

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: generated tokens over the time spent generating them."""
        return self.completion_tokens / (self.decode_ms / 1000) if self.decode_ms > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["logprobs"] = [lp.to_list() for lp in self.logprobs]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Chunk:
        lps = tuple(TokenLogprob.from_list(x) for x in data.get("logprobs") or ())
        return cls(**{**data, "logprobs": lps})
