"""Request bodies of both API families (pydantic). Their generation settings are fields made from
settings.py's table (each setting under its name in the API), read back by `settings()` with the
table's checks; settings.resolve then decides them once.

Unknown fields are ignored, as OpenAI's and Ollama's own servers do with fields they do not
know; fields that would change the answer and that localrun cannot honour are refused.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator
from pydantic_core import PydanticCustomError

from localrun import settings
from localrun.constraint import Constraint
from localrun.errors import UsageError
from localrun.server import parse_duration
from localrun.settings import LoadOptions

MAX_N = 16  # choices per request (each one is a sequence in the engine)


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


class RequestBody(_Body):
    """A whole request body: its text is checked once, nested parts included."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if _has_lone_surrogate(data):
            raise PydanticCustomError("unpaired_surrogate", "the request body holds text with an unpaired "
                                      "surrogate escape (\\ud800-\\udfff); send valid Unicode")
        return data


# JSON's kinds for each kind of setting: pydantic checks the kind, the table the range.
_WIRE: dict[str, Any] = {"float": float, "int": int, "bool": bool, "stops": str | list[str], "bias": dict[str, Any],
                         "drafter": bool | str, "text": str, "choice": str}


def with_settings(front: str, base: type[BaseModel], only: tuple[str, ...] = ()) -> Any:
    """`base` with a field for each setting the API names (settings.named; `only` those), and one
    for each field of the API that localrun refuses (settings.REFUSED), so a request that sets it
    can be refused."""
    fields: dict[str, Any] = {name: (_WIRE[s.kind] | None, None) for name, s in settings.named(front).items()
                              if not only or name in only}
    if not only:
        fields.update({name: (Any, None) for name in settings.REFUSED.get(front, {})})
    return create_model(f"{base.__name__}_{front}", __base__=base, **fields)


class SettingsBody(RequestBody):
    """A body with the table's fields for its API (FRONT)."""

    FRONT: ClassVar[str] = ""

    def settings(self) -> dict[str, Any]:
        """The settings this body gives, by field name, checked by the table; refused fields are a 400."""
        return given_settings(self, self.FRONT)


def given_settings(body: BaseModel, front: str, scope: str | None = None) -> dict[str, Any]:
    names = settings.named(front, scope)
    values = {k: getattr(body, k) for k in body.model_fields_set if k in names or k in settings.REFUSED.get(front, {})}
    settings.refuse(front, values)
    return settings.read({k: v for k, v in values.items() if k in names}, front)


if TYPE_CHECKING:
    _OpenAISettings = SettingsBody
else:
    _OpenAISettings = with_settings("openai", SettingsBody)


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


class Sampling(_OpenAISettings):
    """The fields common to chat and text completions; the sampling and stopping ones come from the table."""

    FRONT: ClassVar[str] = "openai"
    lora: list[LoraRef] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=20)] = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    # Off unless asked for, as in llama-server: a small model given room for more calls repeats its first.
    parallel_tool_calls: bool = False
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template, as llama-server does

    @property
    def think(self) -> bool | str | None:
        """The request's thinking switch: reasoning_effort "none" turns it off, "minimal" is "low"."""
        if self.reasoning_effort is None:
            return None
        if self.reasoning_effort == "none":
            return False
        return "low" if self.reasoning_effort == "minimal" else self.reasoning_effort

    def settings(self) -> dict[str, Any]:
        if self.top_logprobs is not None and not self.logprobs:
            raise UsageError("top_logprobs needs logprobs", "set logprobs to true")
        return {**super().settings(), **({"logprobs": self.top_logprobs or 0} if self.logprobs else {})}

    def constraint(self) -> Constraint | None:
        return response_constraint(self.response_format)


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

    def settings(self) -> dict[str, Any]:
        if self.suffix:
            raise UsageError("suffix (fill-in-the-middle) is not supported yet", "send the request without suffix")
        if self.best_of not in (None, 1, self.n):
            raise UsageError("best_of is not supported", "use n to get several completions")
        if self.echo and self.logprobs is not None:
            raise UsageError("echo with logprobs is not supported", "drop echo or logprobs")
        return {**super().settings(), **({"logprobs": self.logprobs} if self.logprobs is not None else {})}

    def constraint(self) -> Constraint | None:
        return response_constraint(self.response_format)  # an extension, as llama-server has


class EmbeddingRequest(RequestBody):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int | None, Field(ge=1)] = None
    user: str | None = None

    def texts(self) -> list[str | list[int]]:
        """The inputs: texts, or token arrays (one list of ids, or a list of them) taken as they are."""
        value = self.input
        if isinstance(value, list) and value and all(isinstance(p, int) for p in value):
            return [[int(p) for p in value if isinstance(p, int)]]
        if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
            return [list(p) for p in value if isinstance(p, list)]
        return list(_texts(value, "input"))


class RerankDocument(RequestBody):
    text: str


class RerankRequest(RequestBody):
    """/v1/rerank as Jina's, Cohere's and llama-server's clients send it (documents, top_n,
    return_documents), or as Text Embeddings Inference does (texts, return_text)."""

    model: str
    query: str
    documents: list[str | RerankDocument] | None = None
    texts: list[str] | None = None
    top_n: Annotated[int | None, Field(ge=0)] = None
    return_documents: bool = False
    return_text: bool = False
    # Cohere's and TEI's options that change nothing for one local model
    max_chunks_per_doc: int | None = None
    raw_scores: bool = False
    truncate: bool | None = None

    def docs(self) -> list[str]:
        if self.documents is not None and self.texts is not None:
            raise UsageError("send documents or texts, not both")
        docs = self.texts if self.texts is not None else self.documents
        if not docs:
            raise UsageError("documents must be a non-empty list of strings",
                             'send {"query": "...", "documents": ["...", "..."]}')
        return [d if isinstance(d, str) else d.text for d in docs]


# -- Ollama ---------------------------------------------------------------------------------


class _Named(RequestBody):
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


if TYPE_CHECKING:
    _OllamaSettings = _Body
else:
    _OllamaSettings = with_settings("ollama", _Body)


class OllamaOptions(_OllamaSettings):
    """The options Ollama accepts (the table's fields under their Ollama names). Of the load-time
    ones, num_ctx (the least context per sequence the request needs) and kv_cache_type (localrun's
    extension: Ollama sets the cache type for the whole server, OLLAMA_KV_CACHE_TYPE) choose the
    loaded instance that answers; the others (num_gpu, num_thread, ...) follow the server's
    settings and are ignored (settings.IGNORED)."""

    def load_options(self, base: LoadOptions) -> LoadOptions | None:
        """The server's load options with this request's num_ctx and kv_cache_type (None: neither is set)."""
        load = given_settings(self, "ollama", "load")
        return replace(base, **load) if load else None

    def settings(self) -> dict[str, Any]:
        return given_settings(self, "ollama", "generation")


class _Loading(_Named):
    keep_alive: float | str | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)

    def keep_alive_seconds(self) -> float | None:
        """Seconds to keep the model loaded after this request; None: the server's default."""
        return None if self.keep_alive is None else parse_duration(self.keep_alive)


# localrun's extensions that Ollama's requests also take beside their options: thought budget, drafts
_OLLAMA_TOP = ("think_budget", "speculative")
if TYPE_CHECKING:
    _OllamaTop = _Loading
else:
    _OllamaTop = with_settings("ollama", _Loading, only=_OLLAMA_TOP)


class OllamaGenerating(_OllamaTop):
    """Fields common to /api/chat and /api/generate."""

    lora: list[LoraRef] | None = None
    stream: bool = True
    format: Any = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0

    def settings(self) -> dict[str, Any]:
        """The options' settings, with the top-level think_budget and speculative over them."""
        top = settings.read({k: getattr(self, k) for k in _OLLAMA_TOP if k in self.model_fields_set}, "ollama")
        return {**self.options.settings(), **top, **({"logprobs": self.top_logprobs} if self.logprobs else {})}

    def constraint(self) -> Constraint | None:
        if self.format == "json":
            return Constraint.json_object()
        if isinstance(self.format, dict):
            return Constraint.schema(self.format, "format schema")
        if self.format not in (None, ""):
            raise UsageError(f"format must be \"json\" or a JSON schema, not {self.format!r}")
        return None


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

    def settings(self) -> dict[str, Any]:
        if self.raw and (self.template or self.system or self.context):
            raise UsageError("raw mode does not support template, system, or context")
        if self.suffix:
            raise UsageError(f"'{self.model}' does not support insert (suffix)", "send the request without suffix")
        if self.context:
            raise UsageError("context (token arrays from an earlier reply) is not supported", "use /api/chat with messages")
        return super().settings()


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


class OllamaCopyRequest(RequestBody):
    source: str
    destination: str

