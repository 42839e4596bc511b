"""The engine seam: the step-level protocol every engine implements, the typed session that
front ends use, and the registry of engines.

An engine (llama.cpp, MLX) only knows how to hold sequences and advance them one step; the
engine loop (loop.py) does everything above that once for all engines: the request queue,
continuous admission, prefix reuse, stops, budgets, cancellation and streaming.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from localrun.errors import BackendUnavailableError, LocalrunError
from localrun.generation import Chunk, Request, TokenLogprob
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo

if TYPE_CHECKING:
    from localrun.reasoning import ReasoningFormat


class Cancel(Protocol):
    """Anything with is_set(), e.g. threading.Event; checked between steps."""

    def is_set(self) -> bool: ...


# Encoder architectures (GGUF names): they embed or rank and never generate.
EMBEDDING_ARCHS = ("bert", "nomic-bert", "jina-bert-v2", "jina-bert-v3", "t5encoder", "modern-bert", "neo-bert")


@dataclass(frozen=True)
class Abilities:
    """What an engine can do besides generating text, declared once on its classes; the CLI's
    choices, `doctor`, the engine messages and the adapter routing read these, never its name."""

    request_adapters: bool = False  # LoRA adapters applied per request on a base that stays loaded (set_lora)
    load_adapters: bool = False  # LoRA adapters (PEFT folders) applied when the model loads
    expert_offload: bool = False  # --cpu-moe: a mixture-of-experts model's expert weights kept in host memory
    embeddings: bool = False
    images: bool = False
    drafting: bool = False  # speculative decoding: drafts verified in the batched decode (--draft lookup|MODEL)
    structured_output: bool = False  # replies held to a grammar (JSON schema, GBNF, choice)

    def names(self) -> list[str]:
        """The abilities it has, as words ("request adapters", "embeddings", ...)."""
        return [f.name.replace("_", " ") for f in fields(self) if getattr(self, f.name)]


@dataclass(frozen=True)
class Embeddings:
    """Pooled, normalised embedding vectors, one per input text."""

    vectors: list[list[float]]
    prompt_tokens: int


@dataclass(frozen=True)
class Ranked:
    """A reranker's raw score of each document for one query, in the documents' order."""

    scores: list[float]
    prompt_tokens: int

    def order(self, top_n: int | None = None) -> list[int]:
        """The documents' indexes, best score first (ties keep the documents' order), at most top_n."""
        best = sorted(range(len(self.scores)), key=lambda i: -self.scores[i])
        return best if top_n is None else best[:top_n]


@dataclass(frozen=True)
class Sampled:
    """What one step produced for one sequence."""

    slot: int
    token: int
    logprob: TokenLogprob | None = None
    broken: bool = False  # the token breaks the sequence's constraint (an end before it is complete)


def render_chat(template: str, reasoning: ReasoningFormat | None, request: Request, bos_token: str,
                eos_token: str) -> str:
    """A chat request rendered with the model's template, as every engine renders it: the tools,
    the reasoning format's switches (the client's template kwargs win) and earlier turns'
    thoughts under the format's history field."""
    from localrun.chat import render_template, thinking_inputs

    sw = reasoning.switch(request.think) if reasoning is not None else None
    messages, extras = thinking_inputs(request.messages, sw.variables if sw else {}, sw.system_flag if sw else None,
                                       request.template_kwargs)
    return render_template(template, messages, bos_token=bos_token, eos_token=eos_token,
                           history_field=reasoning.history_field if reasoning is not None else None,
                           **{**request.template_extras(), **extras})


def token_logprob(logprobs: Any, token: int, top: int, piece: Callable[[int], bytes]) -> TokenLogprob:
    """The sampled token's log-probability and the `top` most likely tokens at its position.

    Args:
        logprobs: a numpy vector of log-probabilities over the vocabulary.
        piece: a token's bytes.
    """
    import numpy as np

    def one(t: int) -> TokenLogprob:
        data = piece(t)
        return TokenLogprob(data.decode("utf-8", errors="replace"), float(logprobs[t]), tuple(data))

    alts: tuple[TokenLogprob, ...] = ()
    if top > 0:
        best = np.argpartition(-logprobs, top)[:top]
        alts = tuple(one(int(t)) for t in best[np.argsort(-logprobs[best])])
    chosen = one(token)
    return TokenLogprob(chosen.token, chosen.logprob, chosen.bytes, alts)


class Detokenizer(Protocol):
    """Turns a sequence's tokens into text incrementally (never splits a UTF-8 character)."""

    def feed(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Engine(Protocol):
    """A loaded model with a fixed number of sequence slots; the engine loop drives it.

    Each slot holds one sequence's KV cache. The loop places a request in a slot with start(),
    calls step() until the request ends, then finish() (the KV cache stays, so a later request
    with the same prefix can reuse it).
    """

    abilities: ClassVar[Abilities]  # the same as its Backend's
    n_ctx: int  # tokens per sequence
    n_vocab: int  # tokens in the vocabulary (a logit bias may name any of them)
    n_slots: int
    can_copy: bool  # whether start() can copy a prefix from another slot's KV cache
    can_save: bool  # whether save() and restore() move a slot's sequence state to host memory and back
    # How the model writes its thought apart from its answer (from its chat template and vocabulary,
    # detected once at load), or None for a model that does not think
    reasoning: ReasoningFormat | None

    def prompt_tokens(self, request: Request, stops: list[str]) -> list[int]:
        """Render (chat template or raw) and tokenize; may add the template's own stop strings."""
        ...

    def start(self, slot: int, tokens: list[int], params: GenerationParams, seed: int, source: int, keep: int) -> int:
        """Place a sequence in slot; the first `keep` tokens are already in slot `source`'s KV cache.

        Returns:
            How many prompt tokens were reused (the engine may reuse fewer than asked).
        """
        ...

    def prefill(self, slot: int, tokens: list[int], start: int) -> None:
        """Evaluate tokens[start:] into slot's KV cache without sampling (a shared prefix)."""
        ...

    def save(self, slot: int) -> tuple[Any, int] | None:
        """A copy of the slot's sequence state in host memory and its size in bytes (can_save),
        or None when it cannot be copied."""
        ...

    def restore(self, slot: int, state: Any) -> bool:
        """Put a saved sequence state into slot (replacing what it held); False if it failed, and
        the slot is then empty."""
        ...

    def set_lora(self, lora: tuple[tuple[str, float], ...]) -> None:
        """Apply these adapters (file, scale) to every sequence started or stepped from now on.

        Raises:
            UsageError: the engine applies adapters when it loads (abilities.request_adapters is False).
            BadModelFileError: an adapter cannot be applied to this model.
        """
        ...

    def step(self) -> list[Sampled]:
        """One forward pass over every started sequence: the last sampled token of each
        generating one and the next chunk of each prompt; returns the sequences that sampled."""
        ...

    def finish(self, slot: int) -> int:
        """Stop the sequence in slot; its KV cache is kept for prefix reuse.

        Returns:
            How many of the sequence's tokens (prompt, then generated) its KV cache holds.
        """
        ...

    def is_eog(self, token: int) -> bool:
        """Whether token ends generation (EOS, EOT...)."""
        ...

    def text_tokens(self, text: str) -> list[int]:
        """Tokenize text as generated output (control tokens by their text, no BOS)."""
        ...

    def force(self, slot: int, tokens: list[int]) -> None:
        """Make the sequence in slot sample exactly these tokens next, one per step (a thinking
        budget's closing marker); the loop sees them as sampled tokens."""
        ...

    def drafts(self, slot: int) -> tuple[int, int]:
        """Speculative decoding (abilities.drafting): the tokens drafted for the slot's reply so far
        and how many of them the model kept; a step then gives several Sampled for the slot, in order."""
        ...

    def images_encoded(self, slot: int) -> int:
        """Images (abilities.images): how many the slot's prompt evaluation encoded. An engine that
        reads images gives each image's positions in the prompt as negative placeholder tokens
        (the same image, the same placeholders), so that prefix matching finds images in caches."""
        ...

    def prompt_cells(self, tokens: list[int]) -> int:
        """Images: the KV cells a prompt with image placeholders fills (an image counts its
        embeddings, which may be more than the positions its placeholders stand for)."""
        ...

    def detokenizer(self, special: bool = False) -> Detokenizer:
        """A fresh incremental detokenizer for one reply (special: control tokens as text too)."""
        ...

    def embed(self, texts: list[str | list[int]]) -> Embeddings:
        """Embedding vectors for texts (or token id lists)."""
        ...

    def rerank(self, query: str, documents: list[str]) -> Ranked:
        """A reranker's score of each document for the query."""
        ...

    def info(self) -> dict[str, Any]:
        """What the engine reports about the loaded model (context, offload, threads)."""
        ...

    def close(self) -> None:
        """Free the model."""
        ...


class Backend(Protocol):
    """An inference engine: declares its name, formats, install hint and abilities once, on the class."""

    name: ClassVar[str]  # what --engine takes
    title: ClassVar[str]  # how messages name it ("llama.cpp", "MLX")
    formats: ClassVar[tuple[str, ...]]  # the model formats it loads, as the store detects them
    install_hint: ClassVar[str]
    packages: ClassVar[tuple[str, ...]]  # its distributions, whose versions doctor reports
    abilities: ClassVar[Abilities]
    # Formats it can make its own copy of, and how (a hint with {path}): what to do when a model
    # is in a format this engine does not load.
    copies_from: ClassVar[tuple[str, ...]]
    copy_hint: ClassVar[str]

    def available(self) -> bool:
        """Cheap probe: is the engine installed and usable here?"""
        ...

    def warm(self) -> None:
        """Import the engine's libraries ahead of a load (an engine process started early)."""
        ...

    def load(self, model: ModelInfo, options: LoadOptions) -> Engine:
        """Load a model.

        Raises:
            BadModelFileError: the engine cannot read the file.
            EngineError: loading failed (e.g. out of memory).
        """
        ...

    def system_info(self) -> dict[str, Any]:
        """Build facts of the engine (versions, device), as JSON values."""
        ...

    @staticmethod
    def describe(facts: dict[str, Any]) -> list[tuple[str, str]]:
        """doctor's lines (label, value) for the facts system_info() reported."""
        ...


class Ticket(Protocol):
    """A request submitted with Session.start."""

    error: LocalrunError | None  # after the end: why it failed (e.g. ContextOverflowError)
    final: Chunk | None  # after the end: the last chunk, with statistics

    def cancel(self) -> None:
        """Stop the request; its last chunk (finish_reason "cancelled") is still delivered."""
        ...

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end; whether it ended within timeout."""
        ...


@dataclass(frozen=True)
class RowResult:
    """A batch row that ended: its reply, or why it could not run."""

    id: Any  # the row's own id, as its input gave it (any JSON value)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seed: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    thinking: str = ""  # a thinking model's thought, apart from text
    thinking_tokens: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted for the reply, and kept
    accepted_tokens: int = 0


@dataclass(frozen=True)
class TokenCounts:
    """Tokens the engine has evaluated so far, running rows included (batch progress)."""

    prompt_tokens: int
    completion_tokens: int


class Session(Protocol):
    """A loaded model as front ends see it (the engine runs in a worker process)."""

    model: ModelInfo
    backend: str

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Generator[Chunk, None, None]:
        """Generate a reply, yielding text chunks and a final chunk with statistics.

        Thread-safe: concurrent streams run as parallel sequences of the same engine loop.

        Args:
            request: chat messages (rendered with the model's template) or a raw prompt.
            params: sampling and stopping settings.
            cancel: checked between steps; when set the stream ends with finish_reason "cancelled".

        Raises:
            ContextOverflowError: the prompt does not fit in the context.
            ServerBusyError: the engine's queue is full.
            EngineCrashedError: the engine process died.
        """
        ...

    def start(self, request: Request, params: GenerationParams, deliver: Callable[[Chunk], None],
              stream: bool = True, report: bool = False) -> Ticket:
        """Submit a request whose chunks go to `deliver` (called on the engine's reader thread);
        with stream False, its text comes in one chunk when it ends, before the final one; with
        report, a first empty chunk carries prompt_tokens and cached_tokens once it is admitted.

        Returns:
            A Ticket: cancel(), wait(timeout) -> bool, and after the end .final (the last
            Chunk) or .error (a LocalrunError, e.g. ContextOverflowError).
        """
        ...

    def generate_many(self, rows: list[tuple[Any, Request, GenerationParams]],
                      cancel: Cancel | None = None) -> Iterator[RowResult | TokenCounts]:
        """Run many requests (row id, request, settings) through the loop, yielding each result
        as it finishes (batch), and the engine's token counts as they grow."""
        ...

    def tokenize(self, request: Request) -> list[int]:
        """The prompt tokens of a request."""
        ...

    def embed(self, texts: list[str | list[int]]) -> Embeddings:
        """Embedding vectors for texts (or token id lists)."""
        ...

    def rerank(self, query: str, documents: list[str]) -> Ranked:
        """A reranker's score of each document for the query."""
        ...

    def info(self) -> dict[str, Any]:
        """What the engine reports about the loaded model."""
        ...

    @property
    def alive(self) -> bool:
        """Whether the engine process is still running."""
        ...

    @property
    def pid(self) -> int:
        """The engine process."""
        ...

    def close(self) -> None:
        """Free the model."""
        ...


# The engines by name, in order of preference: a new engine is its module and one line here. Each
# class declares its name (the same), formats, install hint and abilities; the modules import no
# engine library at import time, and the CLI reads the names without importing even them.
ENGINES = {
    "llama.cpp": "localrun.backends.llama_cpp:LlamaCppBackend",
    "mlx": "localrun.backends.mlx:MLXBackend",
}


def backend_classes() -> list[type[Backend]]:
    """Every engine class (the engine libraries themselves are not imported)."""
    return [backend_class(name) for name in ENGINES]


def backend_names() -> list[str]:
    """Every engine's name, in order of preference (what --engine takes); imports no engine module."""
    return list(ENGINES)


def abilities(name: str) -> Abilities:
    """What an engine can do, by name."""
    return backend_class(name).abilities


def engines_with(ability: str) -> list[str]:
    """The names of the engines that have an ability (a field of Abilities)."""
    return [c.name for c in backend_classes() if getattr(c.abilities, ability)]


def backend_class(name: str) -> type[Backend]:
    """The class of an engine by name."""
    if name not in ENGINES:
        raise BackendUnavailableError(f"unknown engine '{name}'", f"choose one of {', '.join(backend_names())}")
    module_name, cls_name = ENGINES[name].split(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), cls_name)
    if cls.name != name:
        raise AssertionError(f"engine {ENGINES[name]} is registered as '{name}' but calls itself '{cls.name}'")
    return cls


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name."""
    return backend_class(name)()


def install_hint(name: str) -> str:
    """How to install an engine, by name."""
    return backend_class(name).install_hint


def backends_for(fmt: str) -> tuple[str, ...]:
    """Names of the engines that can run a model format, preferred first."""
    return tuple(c.name for c in backend_classes() if fmt in c.formats)
