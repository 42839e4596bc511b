"""Every generation and load setting, declared once, and the one resolver of a request's settings.

A setting is a field of `GenerationParams` or `LoadOptions` declared with `setting(...)`: its type
(the annotation), its default, its check, its help, and its name everywhere outside (a CLI flag, an
OpenAI field, an Ollama option, a Modelfile PARAMETER, a batch row's key, a GGUF's sampling
metadata, the Anthropic and Responses fields). The CLI's flags (cli/options.py), the server's
request fields (server/schemas.py), the Modelfile reader and `show --modelfile` (presets.py) and
batch rows are derived from these declarations, and `read` turns any of those outside forms into
settings by the same rules.

`resolve` decides a request's settings once: the request's own values over a preset's, over the
model's (its GGUF's `general.sampling.*`), over the server's (or the TUI's) defaults; then the
engine's abilities (per-request adapters), the request's constraints (a response format, tools)
and what its drafts and thought allow. Nothing downstream re-packs them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from localrun.errors import UsageError
from localrun.setting import (
    DRAFTERS,
    Setting,
    adapters,
    bias_ok,
    finite,
    negative,
    nonpositive,
    seed_unset,
    setting,
)

if TYPE_CHECKING:
    from localrun.adapters import Target
    from localrun.constraint import Constraint
    from localrun.store import ModelInfo
    from localrun.tools import ToolPlan

# The KV-cache types a model loads with (--kv-type): llama.cpp's cache types; q8_0 and q4_0 store
# 8.5 and 4.5 bits per value, and need flash attention for the V cache.
KV_TYPES = ("f16", "q8_0", "q4_0")


# -- the settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping settings for one reply (see the module's docstring)."""

    temperature: float = setting(
        0.8, kind="float", check=lambda v: finite(v) and v >= 0, expected="a number >= 0",
        help="sampling temperature; 0 is greedy", cli="--temperature", openai="temperature", ollama="temperature",
        modelfile="temperature", batch="temperature", gguf="general.sampling.temp", anthropic="temperature",
        responses="temperature")
    top_p: float = setting(
        0.95, kind="float", check=lambda v: 0 < v <= 1, expected="a number in (0, 1]",
        help="nucleus sampling: keep the most likely tokens up to this probability", cli="--top-p",
        openai="top_p", ollama="top_p", modelfile="top_p", batch="top_p", gguf="general.sampling.top_p",
        anthropic="top_p", responses="top_p")
    top_k: int = setting(
        40, kind="int", check=lambda v: v >= 0, expected="an integer >= 0 (0 disables it)",
        help="keep the k most likely tokens; 0 disables", cli="--top-k", openai="top_k", ollama="top_k",
        modelfile="top_k", batch="top_k", gguf="general.sampling.top_k", anthropic="top_k")
    min_p: float = setting(
        0.05, kind="float", check=lambda v: 0 <= v <= 1, expected="a number in [0, 1]",
        help="drop tokens below min-p x the top probability", cli="--min-p", openai="min_p", ollama="min_p",
        modelfile="min_p", batch="min_p", gguf="general.sampling.min_p")
    typical_p: float = setting(
        1.0, kind="float", check=lambda v: 0 < v <= 1, expected="a number in (0, 1]",
        help="locally typical sampling: keep the tokens closest to the expected surprise up to this "
             "probability; 1 disables", cli="--typical-p", openai="typical_p", ollama="typical_p",
        modelfile="typical_p", batch="typical_p")
    repeat_penalty: float = setting(
        1.0, kind="float", check=lambda v: finite(v) and v > 0, expected="a number > 0 (1 disables it)",
        help="penalty for repeated tokens; 1 disables", cli="--repeat-penalty", openai="repeat_penalty",
        ollama="repeat_penalty", modelfile="repeat_penalty", batch="repeat_penalty",
        gguf="general.sampling.penalty_repeat")
    repeat_last_n: int = setting(
        64, kind="int", check=lambda v: v >= 0, expected="an integer >= 0",
        unset={"ollama": negative, "modelfile": negative},
        help="how many recent tokens the penalties see", cli="--repeat-last-n", openai="repeat_last_n",
        ollama="repeat_last_n", modelfile="repeat_last_n", batch="repeat_last_n",
        gguf="general.sampling.penalty_last_n")
    presence_penalty: float = setting(
        0.0, kind="float", check=lambda v: finite(v) and -2 <= v <= 2, expected="a number in [-2, 2]",
        help="lower the odds of every token already generated", cli="--presence-penalty",
        openai="presence_penalty", ollama="presence_penalty", modelfile="presence_penalty",
        batch="presence_penalty")
    frequency_penalty: float = setting(
        0.0, kind="float", check=lambda v: finite(v) and -2 <= v <= 2, expected="a number in [-2, 2]",
        help="lower a token's odds by how often it was generated", cli="--frequency-penalty",
        openai="frequency_penalty", ollama="frequency_penalty", modelfile="frequency_penalty",
        batch="frequency_penalty")
    # (token id, bias) pairs added to those tokens' logits before sampling; -100 bans a token
    logit_bias: tuple[tuple[int, float], ...] = setting(
        (), kind="bias", check=bias_ok, expected="token ids with biases from -100 to 100",
        help="add BIAS to a token's logit (-100 bans it, 100 forces it); repeatable", metavar="TOKEN=BIAS",
        cli="--logit-bias", openai="logit_bias", batch="logit_bias")
    seed: int | None = setting(
        None, kind="int", check=lambda v: 0 <= v < 2**32, expected="an integer in [0, 2^32) (-1: a random seed)", unset=seed_unset,
        help="random seed for reproducible sampling (default: random)", cli="--seed", openai="seed",
        ollama="seed", modelfile="seed", batch="seed")
    max_tokens: int | None = setting(
        None, kind="int", check=lambda v: v > 0, expected="an integer > 0",
        unset={"ollama": nonpositive, "modelfile": nonpositive},  # -1, -2: no limit but the context
        help="stop after this many tokens (default: until the model stops)", cli=("--max-tokens", "-n"),
        openai=("max_completion_tokens", "max_tokens"), ollama="num_predict", modelfile="num_predict",
        batch="max_tokens", anthropic="max_tokens", responses="max_output_tokens")
    stop: tuple[str, ...] = setting(
        (), kind="stops", help="stop at this text (repeatable)", expected="a string or a list of strings",
        metavar="TEXT", cli="--stop", openai="stop", ollama="stop", modelfile="stop", batch="stop",
        anthropic="stop_sequences", responses="stop")
    # None: off; N: the chosen token's logprob and the N most likely (each API has its own fields)
    logprobs: int | None = setting(
        None, kind="int", check=lambda v: 0 <= v <= 20, expected="an integer in [0, 20]",
        help="log-probabilities of each token and of the N most likely", batch="logprobs")
    # A Lark grammar (llguidance) the output must match, from the request's constraint: see constraint.py
    grammar: str | None = None
    grammar_trigger: str | None = None  # the grammar applies from this text on (a lazy grammar), else from the start
    special: bool = False  # render control tokens as text (tool-call openers such as [TOOL_CALLS])
    # GGUF LoRA adapters applied to this reply, as (adapter file, scale); the base model stays loaded
    lora: tuple[tuple[str, float], ...] = ()
    # A thinking model's thought ends after this many tokens: the loop inserts the format's closing marker
    think_budget: int | None = setting(
        None, kind="int", check=lambda v: v >= 0, expected="an integer >= 0 (tokens of thought)", group="thinking",
        help="end the thought after N tokens (the format's closing marker is inserted), then answer",
        metavar="N", cli="--think-budget", openai="think_budget", ollama="think_budget", modelfile="think_budget",
        batch="think_budget", responses="think_budget")
    # Speculative decoding: "lookup" drafts from the prompt and the reply so far, "model" with the
    # draft model loaded beside the model (LoadOptions.draft); None: off
    speculative: str | None = setting(
        None, kind="drafter", check=lambda v: v in DRAFTERS, expected=f"one of {', '.join(DRAFTERS)}",
        group="speculative decoding", metavar="lookup|MODEL",
        help="draft tokens and verify them in one batched step, with the same reply: 'lookup' drafts from the "
             "prompt and the reply so far (rewrites and edits that repeat their input gain most); a MODEL (a "
             "smaller one with the same vocabulary) drafts with that model",
        cli="--draft", openai="speculative", ollama="speculative", modelfile="draft", batch="speculative",
        responses="speculative")
    # Each step drafts up to draft_max tokens, and none when fewer than draft_min would fit
    draft_max: int = setting(
        8, kind="int", check=lambda v: 1 <= v <= 64, expected="an integer in [1, 64]", group="speculative decoding",
        help="tokens drafted per step at most", metavar="N", cli="--draft-max", modelfile="draft_max",
        batch="draft_max")
    draft_min: int = setting(
        1, kind="int", check=lambda v: 1 <= v <= 64, expected="an integer in [1, 64]", group="speculative decoding",
        help="draft only when at least N tokens can be drafted", metavar="N", cli="--draft-min",
        modelfile="draft_min", batch="draft_min")
    draft_always: bool = setting(
        False, kind="bool", expected="true or false", group="speculative decoding",
        help="keep drafting where the measured costs say it does not pay (by default a sequence stops drafting "
             "when its drafts cost more than they save)", cli="--draft-always", modelfile="draft_always",
        batch="draft_always")

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "lora", adapters(self.lora))
        if self.think_budget is not None and self.speculative is not None:
            # a thought's budget ends it at an exact token; drafts could run past it within a step
            object.__setattr__(self, "speculative", None)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        for s in GENERATION.values():
            s.valid(getattr(self, s.name), s.flag)
        if self.draft_min > self.draft_max:
            raise UsageError(f"invalid value for --draft-min: {self.draft_min}",
                             f"expected an integer in [1, --draft-max ({self.draft_max})]")
        if self.grammar_trigger is not None and (self.grammar is None or self.grammar_trigger == ""):
            raise UsageError(f"invalid value for grammar_trigger: {self.grammar_trigger!r}",
                             "expected a non-empty text, with a grammar")

    def budget(self, n_ctx: int, n_prompt: int) -> int:
        """How many tokens the reply may have: max_tokens, within what the context has left."""
        return min(self.max_tokens or n_ctx, n_ctx - n_prompt)

    @property
    def penalized(self) -> bool:
        """Whether any repetition penalty applies."""
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def choice(self, i: int) -> GenerationParams:
        """The settings of a request's choice i (OpenAI's n): other seeds when a seed was given, so
        choices differ."""
        if i == 0 or self.seed is None:
            return self
        return replace(self, seed=(self.seed + i) % 2**32)

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

    # tokens per sequence; None: the model's trained context if memory holds it (fit.context_for)
    n_ctx: int | None = setting(
        None, kind="int", check=lambda v: 16 <= v <= 1 << 22, expected="an integer of at least 16", group="engine",
        help="context length in tokens per sequence (default: the model's trained context when memory holds it "
             "for every sequence; 'localrun show' says which)", cli="--ctx", ollama="num_ctx", modelfile="num_ctx")
    n_threads: int | None = setting(
        None, kind="int", check=lambda v: 1 <= v <= 1024, expected="an integer >= 1", group="engine",
        help="CPU threads (default: every core up to 4)", cli="--threads", modelfile="num_thread")
    gpu_layers: int | str = setting(
        "auto", kind="layers", check=lambda v: v == "auto" or (isinstance(v, int) and v >= -1), group="engine",
        expected="'auto' or an integer >= 0", metavar="N|auto", unset=negative,
        help="layers to offload to the GPU (default auto: all that fit)", cli="--gpu-layers", modelfile="num_gpu")
    flash_attn: bool | None = setting(
        None, kind="switch", expected="auto, on or off", group="engine", choices=("auto", "on", "off"),
        help="flash attention (auto: the engine decides; on with a quantized --kv-type)", cli="--flash-attn")
    n_batch: int = setting(
        512, kind="int", check=lambda v: v >= 1, expected="an integer >= 1", group="engine",
        help="tokens evaluated per step of a prompt", modelfile="num_batch")
    n_parallel: int = 1
    max_queue: int = 0  # requests waiting beyond n_parallel; 0: unbounded
    # MiB of host memory for prompt prefixes evicted from the KV cache (restored when a prompt
    # starts with one again); None: 4096, at most an eighth of the memory; 0: none
    cache_ram: int | None = None
    # LoRA adapters applied when the model loads, as (PEFT adapter folder, scale): the MLX engine's
    # way (llama.cpp applies GGUF adapters per request instead: GenerationParams.lora).
    lora: tuple[tuple[str, float], ...] = ()
    # Mixture-of-experts models: the expert tensors of the first N layers ("all": every layer) stay
    # in host memory, as llama.cpp's --n-cpu-moe / --cpu-moe do; 0: placed like the other tensors.
    cpu_moe: int | str = setting(
        0, kind="moe", check=lambda v: v == "all" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        expected="'all' or a number of layers >= 0", group="engine", metavar="N|all",
        help="mixture-of-experts models: keep the expert weights of the first N layers (all: every layer) in CPU "
             "memory, so that a model larger than the GPU runs (engines with expert offload, see 'localrun "
             "doctor'; an error on a model without experts)", cli="--cpu-moe")
    kv_type: str = setting(
        "f16", kind="choice", check=lambda v: v in KV_TYPES, expected=" or ".join(KV_TYPES), group="engine",
        choices=KV_TYPES, help="the KV cache's type: q8_0 takes about half the memory of f16 (the default), q4_0 "
                               "about a quarter, at some cost in quality; llama.cpp turns flash attention on for them",
        cli="--kv-type", ollama="kv_cache_type", modelfile="kv_cache_type")
    # Speculative decoding's draft model (a GGUF file with the model's vocabulary), loaded beside it;
    # a draft whose vocabulary does not match is refused, or with draft_optional dropped with a note
    draft: str | None = None
    draft_optional: bool = False
    # A vision model's projector (mmproj GGUF) when it is not recorded with the model in the store
    mmproj: str | None = None

    def __post_init__(self) -> None:
        for s in LOAD.values():
            s.valid(getattr(self, s.name), s.flag)
        if self.kv_type != "f16" and self.flash_attn is False:
            raise UsageError(f"--kv-type {self.kv_type} needs flash attention, and --flash-attn is off",
                             "drop --flash-attn off (flash attention then turns on for a quantized cache), "
                             "or keep the f16 cache")
        _check(self.n_parallel >= 1, "--parallel", self.n_parallel, "an integer >= 1")
        _check(self.max_queue >= 0, "--max-queue", self.max_queue, "an integer >= 0")
        _check(self.cache_ram is None or self.cache_ram >= 0, "--cache-ram", self.cache_ram, "MiB >= 0")
        object.__setattr__(self, "lora", adapters(self.lora))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(cond: bool, flag: str, value: Any, expected: str) -> None:
    if not cond:
        raise UsageError(f"invalid value for {flag}: {value!r}", f"expected {expected}")


def _table(cls: type) -> dict[str, Setting]:
    out = {}
    for f in fields(cls):
        spec = f.metadata.get("setting")
        if spec is not None:
            out[f.name] = Setting(name=f.name, default=f.default, scope="load" if cls is LoadOptions else "generation",
                                  **spec)
    return out


GENERATION: dict[str, Setting] = _table(GenerationParams)
LOAD: dict[str, Setting] = _table(LoadOptions)
SETTINGS: dict[str, Setting] = {**GENERATION, **LOAD}


# Fields of the APIs that sample or stop, that localrun does not implement: a request that sets one
# to anything but its neutral value is refused with a 400 naming it (never silently dropped).
REFUSED: dict[str, dict[str, Any]] = {
    "openai": {"prediction": None, "audio": None, "web_search_options": None, "modalities": ["text"],
               "functions": None, "function_call": None},  # the last two: the old form of tools
    "ollama": {"mirostat": 0, "mirostat_tau": None, "mirostat_eta": None, "tfs_z": 1.0},
    # background runs, server-side conversations and prompt templates, dropping old items to fit
    "responses": {"background": False, "conversation": None, "prompt": None, "truncation": "disabled",
                  "image": None},
    # a code-execution container and MCP servers Anthropic would run
    "anthropic": {"container": None, "mcp_servers": None},
}
# Fields of the APIs that localrun accepts and does not use: they change no token of the reply
# (OpenAI's bookkeeping; Ollama's load-time options, which follow the server's own settings).
IGNORED: dict[str, tuple[str, ...]] = {
    "openai": ("user", "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
               "prompt_cache_options", "safety_identifier", "moderation", "verbosity"),
    "ollama": ("num_keep", "penalize_newline", "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv",
               "vocab_only", "use_mmap", "use_mlock", "num_thread", "logits_all", "embedding_only"),
    "responses": ("user", "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
                  "safety_identifier", "moderation", "stream_options", "access_programs", "background_options",
                  "context_management", "client_metadata"),
    "anthropic": ("metadata", "service_tier", "cache_control", "context_management", "diagnostics", "inference_geo",
                  "speed", "user_profile_id", "workspace_id"),
}


def named(front: str, scope: str | None = None) -> dict[str, Setting]:
    """The settings a front takes, by each of their names there."""
    out: dict[str, Setting] = {}
    for s in SETTINGS.values():
        if scope is None or s.scope == scope:
            for n in s.names.get(front, ()):
                out[n] = s
    return out


def refuse(front: str, values: Mapping[str, Any]) -> None:
    """A 400 naming the first field of `values` that changes the reply and that localrun does not implement."""
    for key, neutral in REFUSED.get(front, {}).items():
        value = values.get(key)
        if value is not None and value != neutral and not (neutral is None and key.startswith("mirostat_")):
            raise UsageError(f"'{key}' is not supported by localrun (it would change the reply)",
                             f"send the request without {key}", param=key)


# -- reading outside forms ----------------------------------------------------------------------


def read(values: Mapping[str, Any], front: str, strict: bool = True, nulls: bool = True) -> dict[str, Any]:
    """Settings (by field name) from a mapping in a front's names and JSON types: types and checks
    as the table says, "not set" values dropped (Ollama's seed -1), the first of several names
    winning (max_completion_tokens over max_tokens). Unknown names are an error when strict; null
    is "not set" when nulls, else only for a setting whose default is null (a batch row)."""
    index = named(front)
    out: dict[str, Any] = {}
    rank: dict[str, int] = {}
    for key, value in values.items():
        s = index.get(key)
        if s is None:
            if strict:
                raise UsageError(f"unknown setting(s) {key!r}", f"known: {', '.join(sorted(index))}")
            continue
        label = repr(key) if front in ("openai", "ollama", "anthropic", "responses") else key
        if value is None and not nulls and s.default is not None:
            raise UsageError(f"invalid value for {label}: None", f"expected {s.expected or s.kind}")
        if value is None or s.is_unset(value, front):
            continue
        order = s.names[front].index(key)
        if rank.get(s.name, order) < order:
            continue
        try:
            out[s.name], rank[s.name] = s.coerce(value, label, front), order
        except UsageError as e:
            raise UsageError(e.message, e.hint, param=key) from None
    return out


def read_text(name: str, text: str, front: str = "modelfile") -> Any:
    """One setting's value from text under its name in a front (a Modelfile PARAMETER), as the
    front keeps it (see Setting.parse)."""
    return named(front)[name].parse(text, name, front)


def from_args(args: Any) -> dict[str, Any]:
    """The generation settings a command's parsed flags set (cli/options.py declares them from the table)."""
    out: dict[str, Any] = {}
    for s in GENERATION.values():
        if s.outside("cli") is None:
            continue
        value = getattr(args, s.name, None)
        if value is None or (isinstance(value, list) and not value):
            continue
        if s.kind == "bias":
            value = [pair for part in value for pair in part]  # each flag gave its pairs
        out[s.name] = s.coerce(value, s.flag, "cli")
    return out


def gguf_values(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a GGUF declares (general.sampling.*, as llama.cpp reads them); a value
    out of range is left out."""
    out: dict[str, Any] = {}
    for key, s in named("gguf").items():
        if key in metadata:
            try:
                value = s.coerce(metadata[key], key, "gguf")
            except UsageError:
                continue
            if not s.is_unset(value, "gguf"):
                out[s.name] = value
    return out


def model_values(model: ModelInfo | None) -> dict[str, Any]:
    """A model's own sampling defaults: its GGUF's general.sampling.* keys."""
    if model is None:
        return {}
    return gguf_values(model.details.get("metadata") or {})


def modelfile_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The generation settings of a preset's PARAMETERs (stored by their Modelfile names, as written)."""
    values = {k: v for k, v in parameters.items() if k in named("modelfile", "generation")}
    return read(values, "modelfile", strict=False)


def modelfile_load_values(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The load options a preset's PARAMETERs set (num_gpu -1: auto)."""
    out = {}
    for k, v in parameters.items():
        s = named("modelfile", "load").get(k)
        if s is not None:
            out[s.name] = "auto" if s.kind == "layers" and isinstance(v, int) and v < 0 else v
    return out


# -- the resolver ---------------------------------------------------------------------------------


def layers(*values: Mapping[str, Any] | None) -> dict[str, Any]:
    """Several layers of settings, the later ones over the earlier (an empty stop list counts as not given)."""
    out: dict[str, Any] = {}
    for layer in values:
        for k, v in (layer or {}).items():
            if not (k == "stop" and not v):
                out[k] = v
    return out


def resolve(request: Mapping[str, Any] | None = None, target: Target | None = None, engine: str | None = None, *,
            defaults: Mapping[str, Any] | None = None, constraint: Constraint | None = None,
            tools: ToolPlan | None = None, model: ModelInfo | None = None) -> GenerationParams:
    """The settings of one request, decided once.

    Args:
        request: the settings the request itself gives (by field name; `read` makes them from any front).
        target: the model, its adapters and its preset: the preset's settings go under the request's,
            the model's own (its GGUF's general.sampling.*) under the preset's.
        engine: the engine that runs it: one that applies adapters per request gets their files.
        defaults: the server's (or the TUI's) settings, under all the others.
        constraint: the request's response format (its grammar).
        tools: the request's tools (their call grammar, and control tokens rendered as text).
        model: the model, when there is no target.

    Returns:
        The final GenerationParams: what the engine runs, with nothing left to add.

    Raises:
        UsageError: a value out of range, a response format together with tools, a draft model asked
            for where none is loaded.
    """
    base = target.model if target is not None else model
    preset = modelfile_values(target.preset.parameters) if target is not None and target.preset else {}
    values = layers(defaults, model_values(base), preset, request)
    drafter = values.get("speculative")
    if drafter == "on":  # the server's drafter, else prompt lookup
        server = (defaults or {}).get("speculative")
        values["speculative"] = server if server in DRAFTERS else "lookup"
    elif drafter == "off":
        values["speculative"] = None
    if constraint is not None:
        values["grammar"] = constraint.grammar
    if tools is not None:
        call = tools.constraint()
        if call is not None and constraint is not None:
            raise UsageError("a response format cannot be combined with tools",
                             "drop response_format/format, or set tool_choice to none")
        values["special"] = True
        if call is not None:
            values["grammar"], values["grammar_trigger"] = call
    if target is not None and target.adapters and engine is not None:
        from localrun.backends.base import abilities

        if abilities(engine).request_adapters:
            values["lora"] = tuple((a.path, s) for a, s in target.adapters)
    return GenerationParams(**values)
