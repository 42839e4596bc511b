"""Request bodies of both API families (pydantic), and their translation to GenerationParams.

Unknown fields are ignored, as OpenAI's and Ollama's own servers do with fields they do not
know; fields that would change the answer and that localrun cannot honour are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from localrun.constraint import Constraint
from localrun.errors import UsageError
from localrun.generation import GenerationParams, LoadOptions
from localrun.server import parse_duration

MAX_N = 16  # choices per request (each one is a sequence in the engine)
SEED_LIMIT = 2**32


def _has_lone_surrogate(data: Any) -> bool:
    """Whether a JSON value holds a string with an unpaired \\uD800-\\uDFFF escape, which no
    UTF-8 text (a prompt for the tokenizer, a reply) can carry. Iterative: bodies nest deeply."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """Clients send `"field": null` for fields they leave unset."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _Request(_Body):
    """A whole request body: its text is checked once, nested parts included."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_lone_surrogate(data):
            raise PydanticCustomError("unpaired_surrogate", "the request body holds text with an unpaired "
                                      "surrogate escape (\\ud800-\\udfff); send valid Unicode")
        return data


# -- OpenAI ---------------------------------------------------------------------------------


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier assistant turn's thought, as llama-server and vLLM take it


class StreamOptions(_Body):
    include_usage: bool = False


class LoraRef(_Body):
    """A LoRA adapter applied to one request (an extension of both APIs): a name from the store."""

    name: Annotated[str, Field(min_length=1)]
    scale: Annotated[float, Field(allow_inf_nan=False)] = 1.0


class Sampling(_Request):
    """Sampling and stopping fields common to chat and text completions."""

    lora: list[LoraRef] | None = None
    temperature: Annotated[float | None, Field(ge=0)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=0)] = None
    repeat_penalty: Annotated[float | None, Field(gt=0)] = None
    seed: Annotated[int | None, Field(lt=SEED_LIMIT)] = None
    stop: str | list[str] | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    presence_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    frequency_penalty: Annotated[float | None, Field(ge=-2, le=2)] = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    speculative: bool | Literal["lookup", "model", "none", "off"] | None = None  # speculative decoding (an extension)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def stops(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)

    def params(self, max_tokens: int | None, logprobs: int | None,
               defaults: dict[str, Any] | None = None) -> GenerationParams:
        """GenerationParams from the fields the client set; the rest keep the preset's, then localrun's, defaults."""
        values: dict[str, Any] = {k: getattr(self, k) for k in (
            "temperature", "top_p", "min_p", "top_k", "repeat_penalty", "presence_penalty", "frequency_penalty")
            if getattr(self, k) is not None}
        if self.seed is not None and self.seed >= 0:  # a negative seed means random, as in llama.cpp
            values["seed"] = self.seed
        if max_tokens is not None:
            values["max_tokens"] = max_tokens
        if logprobs is not None:
            values["logprobs"] = logprobs
        return GenerationParams.layered(defaults, {"stop": self.stops(), **values})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # Off unless asked for, as in llama-server: a small model given room for more calls repeats its first.
    parallel_tool_calls: bool = False
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template, as llama-server does
    think_budget: Annotated[int | None, Field(ge=0)] = None  # tokens of thought

    @property
    def think(self) -> bool | str | None:
        """The request's thinking switch: reasoning_effort "none" turns it off, "minimal" is "low"."""
        if self.reasoning_effort is None:
            return None
        if self.reasoning_effort == "none":
            return False
        return "low" if self.reasoning_effort == "minimal" else self.reasoning_effort

    def generation(self, defaults: dict[str, Any] | None = None) -> GenerationParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise UsageError("top_logprobs needs logprobs", "set logprobs to true")
        params = self.params(self.max_completion_tokens or self.max_tokens,
                             (self.top_logprobs or 0) if self.logprobs else None, defaults)
        if self.think_budget is not None:
            params = replace(params, think_budget=self.think_budget)
        constraint = response_constraint(self.response_format)
        return replace(params, grammar=constraint.grammar) if constraint is not None else params


def response_constraint(fmt: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format: text, json_object, or json_schema ({name, schema, strict})."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "json_schema":
        spec = (fmt or {}).get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise UsageError("response_format json_schema needs {\"json_schema\": {\"name\", \"schema\"}}")
        return Constraint.schema(spec["schema"], "response_format schema")
    raise UsageError(f"response_format type {kind!r} is not supported", "use text, json_object or json_schema")


def _texts(value: str | list[str] | list[int] | list[list[int]], field: str) -> list[str]:
    """A string or a list of strings as a list; token arrays are refused."""
    if isinstance(value, str):
        return [value]
    if not value or not all(isinstance(p, str) for p in value):
        raise UsageError(f"{field} must be a string or a non-empty list of strings",
                         "token arrays are not supported; send the text")
    return [p for p in value if isinstance(p, str)]


class CompletionRequest(Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int | None, Field(ge=0, le=5)] = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None

    def prompts(self) -> list[str]:
        return _texts(self.prompt, "prompt")

    def generation(self, defaults: dict[str, Any] | None = None) -> GenerationParams:
        if self.suffix:
            raise UsageError("suffix (fill-in-the-middle) is not supported yet", "send the request without suffix")
        if self.best_of not in (None, 1, self.n):
            raise UsageError("best_of is not supported", "use n to get several completions")
        max_tokens = self.max_tokens if self.max_tokens is not None else (defaults or {}).get("max_tokens", 16)
        params = self.params(max_tokens, self.logprobs, defaults)
        constraint = response_constraint(self.response_format)  # an extension, as llama-server has
        return replace(params, grammar=constraint.grammar) if constraint is not None else params


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, Field(ge=1)] = None
    user: str | None = None

    def texts(self) -> list[str]:
        return _texts(self.input, "input")


# -- Ollama ---------------------------------------------------------------------------------


class _Named(_Request):
    """Ollama accepts the model under `model` or, in older clients, `name`."""

    model: str = ""
    name: str = ""

    @model_validator(mode="after")
    def _either(self) -> _Named:
        if not self.model:
            self.model = self.name
        return self

    def required_model(self) -> str:
        if not self.model.strip():
            raise UsageError("model is required", "send the model name, e.g. \"model\": \"smollm2:135m\"")
        return self.model.strip()


class OllamaOptions(_Body):
    """The options Ollama accepts. Of the load-time ones, num_ctx (the least context per sequence
    the request needs) and kv_cache_type (localrun's extension: Ollama sets the cache type for the
    whole server, OLLAMA_KV_CACHE_TYPE) choose the loaded instance that answers; the others
    (num_gpu, num_thread, ...) follow the server's settings and are ignored."""

    num_ctx: Annotated[int | None, Field(ge=16, le=1 << 22)] = None
    kv_cache_type: Literal["f16", "q8_0", "q4_0"] | None = None  # generation.KV_TYPES

    temperature: Annotated[float | None, Field(ge=0)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=0)] = None
    repeat_penalty: Annotated[float | None, Field(gt=0)] = None
    repeat_last_n: Annotated[int | None, Field(ge=-1)] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Annotated[int | None, Field(lt=SEED_LIMIT)] = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    think_budget: Annotated[int | None, Field(ge=0)] = None

    def load_options(self, base: LoadOptions) -> LoadOptions | None:
        """The server's load options with this request's num_ctx and kv_cache_type (None: neither is set)."""
        if self.num_ctx is None and self.kv_cache_type is None:
            return None
        return replace(base, n_ctx=self.num_ctx or base.n_ctx, kv_type=self.kv_cache_type or base.kv_type)

    def params(self, logprobs: int | None = None, defaults: dict[str, Any] | None = None) -> GenerationParams:
        values: dict[str, Any] = {k: getattr(self, k) for k in (
            "temperature", "top_p", "min_p", "top_k", "repeat_penalty", "presence_penalty", "frequency_penalty")
            if getattr(self, k) is not None}
        if self.repeat_last_n is not None and self.repeat_last_n >= 0:
            values["repeat_last_n"] = self.repeat_last_n
        if self.seed is not None and self.seed >= 0:  # Ollama's default seed is -1: random
            values["seed"] = self.seed
        if self.num_predict is not None and self.num_predict > 0:  # -1 and -2: no limit but the context
            values["max_tokens"] = self.num_predict
        if logprobs is not None:
            values["logprobs"] = logprobs
        if self.think_budget is not None:
            values["think_budget"] = self.think_budget
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationParams.layered(defaults, {"stop": tuple(s for s in stops if s), **values})


class _Loading(_Named):
    keep_alive: float | str | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)

    def keep_alive_seconds(self) -> float | None:
        """Seconds to keep the model loaded after this request; None: the server's default."""
        return None if self.keep_alive is None else parse_duration(self.keep_alive)


class OllamaGenerating(_Loading):
    """Fields common to /api/chat and /api/generate."""

    lora: list[LoraRef] | None = None
    stream: bool = True
    format: Any = None
    think: bool | Literal["low", "medium", "high"] | None = None
    think_budget: Annotated[int | None, Field(ge=0)] = None  # tokens of thought (also accepted in options)
    speculative: bool | Literal["lookup", "model", "none", "off"] | None = None  # speculative decoding (an extension)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0

    def generation(self, defaults: dict[str, Any] | None = None) -> GenerationParams:
        params = self.options.params(self.top_logprobs if self.logprobs else None, defaults)
        if self.think_budget is not None:
            params = replace(params, think_budget=self.think_budget)
        constraint = None
        if self.format == "json":
            constraint = Constraint.json_object()
        elif isinstance(self.format, dict):
            constraint = Constraint.schema(self.format, "format schema")
        elif self.format not in (None, ""):
            raise UsageError(f"format must be \"json\" or a JSON schema, not {self.format!r}")
        return replace(params, grammar=constraint.grammar) if constraint is not None else params


class OllamaMessage(_Body):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class OllamaChatRequest(OllamaGenerating):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Any] | None = None



class OllamaGenerateRequest(OllamaGenerating):
    prompt: str = ""
    suffix: str = ""
    system: str = ""
    template: str = ""
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    def generation(self, defaults: dict[str, Any] | None = None) -> GenerationParams:
        if self.raw and (self.template or self.system or self.context):
            raise UsageError("raw mode does not support template, system, or context")
        if self.suffix:
            raise UsageError(f"'{self.model}' does not support insert (suffix)", "send the request without suffix")
        if self.context:
            raise UsageError("context (token arrays from an earlier reply) is not supported", "use /api/chat with messages")
        return super().generation(defaults)


class OllamaEmbedRequest(_Loading):
    input: str | list[str] = ""
    truncate: bool | None = None
    dimensions: Annotated[int | None, Field(ge=1)] = None

    def texts(self) -> list[str]:
        """The inputs; an empty string only loads the model."""
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return list(self.input)


class OllamaEmbeddingsRequest(_Loading):
    prompt: str = ""


class OllamaShowRequest(_Named):
    verbose: bool = False


class OllamaDeleteRequest(_Named):
    pass


class OllamaPullRequest(_Named):
    stream: bool = True
    insecure: bool = False


class OllamaCreateRequest(_Named):
    """/api/create: a preset from a Modelfile's text (older clients) or from its fields."""

    from_: str | None = Field(default=None, alias="from")
    modelfile: str | None = None
    system: str | None = None
    template: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[dict[str, Any]] | None = None
    license: str | list[str] | None = None
    adapters: dict[str, str] | None = None
    files: dict[str, str] | None = None
    quantize: str | None = None
    stream: bool = True


class OllamaCopyRequest(_Request):
    source: str
    destination: str

