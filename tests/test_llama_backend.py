"""The llama.cpp engine on real models, through the isolated worker the CLI and TUI use."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from localrun import api
from localrun.errors import ContextOverflowError, EngineCrashedError
from localrun.generation import Chunk, Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo

from .ggufs import without_byte_tokens

GREEDY = GenerationParams(temperature=0)


@pytest.fixture(scope="module")
def smol() -> Iterator[object]:
    session = api.load("smollm2:135m", LoadOptions(n_ctx=2048))
    yield session
    session.close()


@pytest.fixture(scope="module")
def tiny() -> Iterator[object]:
    from .conftest import STORIES, assets_or_skip

    session = api.load(str(assets_or_skip(STORIES)), LoadOptions(n_ctx=256))
    yield session
    session.close()


def collect(session: object, request: Request, params: GenerationParams, cancel: object = None) -> tuple[str, Chunk]:
    parts, last = [], None
    for chunk in api.stream(session, request, params, cancel):  # type: ignore[arg-type]
        if chunk.done:
            last = chunk
        else:
            parts.append(chunk.text)
    assert last is not None
    return "".join(parts), last


def test_chat_answer_from_starter_model(smol: object) -> None:
    text, last = collect(smol, api.build_messages("What is the opposite of hot?"), GREEDY)
    assert "cold" in text.lower()
    assert last.finish_reason == "stop" and last.completion_tokens > 3 and last.prompt_tokens > 10
    assert last.tokens_per_second > 0


def test_raw_completion(smol: object) -> None:
    text, _ = collect(smol, Request.raw("The capital of France is"), GenerationParams(temperature=0, max_tokens=4))
    assert text.startswith(" Paris")


def test_greedy_is_deterministic(smol: object, tiny: object) -> None:
    for session, req in ((smol, api.build_messages("Write a haiku about rain.")), (tiny, Request.raw("Once upon a time"))):
        a = collect(session, req, GenerationParams(temperature=0, max_tokens=40))[0]
        b = collect(session, req, GenerationParams(temperature=0, max_tokens=40))[0]
        assert a == b and len(a) > 20


def test_seeded_sampling_is_reproducible(tiny: object) -> None:
    params = GenerationParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42, max_tokens=40)
    a = collect(tiny, Request.raw("Once upon a time"), params)[0]
    b = collect(tiny, Request.raw("Once upon a time"), params)[0]
    others = {collect(tiny, Request.raw("Once upon a time"), GenerationParams(**{**params.to_dict(), "seed": s}))[0]
              for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds should give different samples"


def test_max_tokens(tiny: object) -> None:
    _, last = collect(tiny, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=7))
    assert last.completion_tokens == 7 and last.finish_reason == "length"


def test_stop_sequences(tiny: object) -> None:
    full, _ = collect(tiny, Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=60))
    word = full.split()[5]
    text, last = collect(tiny, Request.raw("Once upon a time"),
                         GenerationParams(temperature=0, max_tokens=60, stop=(word, "zzzz")))
    assert last.finish_reason == "stop"
    assert text == full[: full.index(word)]
    assert word not in text


def test_context_overflow(tiny: object) -> None:
    with pytest.raises(ContextOverflowError, match="context holds 256"):
        collect(tiny, Request.raw("Once upon a time " * 200), GREEDY)
    # The engine is still usable afterwards.
    text, _ = collect(tiny, Request.raw("Once"), GenerationParams(temperature=0, max_tokens=3))
    assert text


def test_generation_stops_at_full_context(tiny: object) -> None:
    _, last = collect(tiny, Request.raw("Once upon a time"), GREEDY)
    assert last.finish_reason in ("stop", "length")
    assert last.prompt_tokens + last.completion_tokens <= 256


class FrozenWorkerCancel:
    """A cancel flag whose lateness a test can count exactly. After some tokens the test freezes
    the engine worker (SIGSTOP); the stream drains what the worker had already sent, the cancel is
    requested while the worker cannot run, and only then is the worker let go (SIGCONT). Tokens
    the worker generates after the request: at most the one step it was frozen in."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.tokens = 0  # tokens received (a logprob comes with each)
        self.at_request: int | None = None  # tokens received when the cancel was requested
        self.frozen = self.resumed = False
        self._idle = 0  # the stream's polls since its last chunk

    def received(self, chunk: Chunk) -> None:
        self.tokens += len(chunk.logprobs)
        self._idle = 0

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        _, status = os.waitpid(self.pid, os.WUNTRACED)  # returns once the worker is stopped
        assert os.WIFSTOPPED(status)
        self.frozen = True

    def resume(self) -> None:
        if self.frozen and not self.resumed:
            self.resumed = True
            os.kill(self.pid, signal.SIGCONT)

    def is_set(self) -> bool:
        """Polled by the stream between chunks and while it waits for one."""
        if not self.frozen:
            return False
        if self.at_request is None:
            self._idle += 1
            if self._idle < 2:
                return False
            # A whole poll brought nothing from the frozen worker: all it had sent is here.
            self.at_request = self.tokens
            return True
        self.resume()  # polled again: the stream has sent the cancel
        return True


def cancel_late_tokens(session: object, request: Request, params: GenerationParams, after: int) -> tuple[Chunk, int]:
    """Stream a reply, cancel it after `after` tokens; (the final chunk, tokens generated after the request)."""
    cancel = FrozenWorkerCancel(session.pid)  # type: ignore[attr-defined]
    last = None
    try:
        for chunk in api.stream(session, request, replace(params, logprobs=0), cancel):  # type: ignore[arg-type]
            assert last is None, "nothing may follow the final chunk"
            if chunk.done:
                last = chunk
                continue
            cancel.received(chunk)
            if cancel.tokens >= after and not cancel.frozen:
                cancel.freeze()
    finally:
        cancel.resume()
    assert last is not None and cancel.at_request is not None
    return last, last.completion_tokens - cancel.at_request


def test_cancel_between_tokens(smol: object) -> None:
    last, late = cancel_late_tokens(smol, Request.raw("Here is a very long story about a dragon:"),
                                    GenerationParams(temperature=0, max_tokens=500), after=5)
    assert last.finish_reason == "cancelled"
    assert last.completion_tokens >= 5 and late <= 1  # the engine reads requests between tokens
    # The next request starts clean.
    text, _ = collect(smol, Request.raw("The capital of France is"), GenerationParams(temperature=0, max_tokens=4))
    assert text.startswith(" Paris")


def test_prompt_prefix_cache_gives_same_result(smol: object) -> None:
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}]
    # The first turn leaves its prompt in the KV cache; the next one starts with that prompt.
    _, first = collect(smol, api.build_messages("Hi"), GenerationParams(temperature=0, max_tokens=8))
    req = api.build_messages("What is the opposite of hot?", None, history)
    warm_text, warm = collect(smol, req, GREEDY)
    fresh = api.load("smollm2:135m", LoadOptions(n_ctx=2048))
    try:
        cold_text, cold = collect(fresh, req, GREEDY)
    finally:
        fresh.close()
    assert cold.cached_tokens == 0
    assert first.prompt_tokens <= warm.cached_tokens < warm.prompt_tokens == cold.prompt_tokens
    assert warm_text == cold_text and warm.completion_tokens == cold.completion_tokens
    assert "cold" in warm_text.lower()


def test_model_without_template_uses_plain_chat(tiny: object) -> None:
    text, last = collect(tiny, api.build_messages("Tell me a story.", system="Be kind."),
                         GenerationParams(temperature=0, max_tokens=30))
    assert last.completion_tokens > 0 and "\nUser:" not in text


def test_engine_crash_becomes_an_error(stories: Path, tmp_path: Path) -> None:
    """A file that passes no validation here (built to bypass it) aborts llama.cpp natively;
    localrun reports it and keeps running."""
    from localrun.backends.session import WorkerSession

    broken = without_byte_tokens(stories, tmp_path / "nobytes.gguf")
    session = WorkerSession("llama.cpp", ModelInfo("broken", str(broken), "gguf", "path", 0), LoadOptions(n_ctx=64))
    with pytest.raises(EngineCrashedError) as e:
        collect(session, Request.raw("你好"), GREEDY)
    assert "crashed" in e.value.message and "SIGABRT" in e.value.message
    session.close()
    # This process is fine and can load another model.
    ok = api.load(str(stories), LoadOptions(n_ctx=64))
    try:
        assert collect(ok, Request.raw("Once"), GenerationParams(temperature=0, max_tokens=2))[1].completion_tokens == 2
    finally:
        ok.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_engine_started_early_is_the_one_the_load_takes_and_one_left_unused_is_closed(
        starter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun.backends import session as sessions
    from localrun.backends.isolation import Child

    warmed: list[str] = []  # the engines the early processes were told to warm
    send = Child.send

    def spy(self: Child, message: dict) -> None:
        if message.get("op") == "warm":
            warmed.append(message["backend"])
        send(self, message)

    monkeypatch.setattr(Child, "send", spy)
    with api.engine_started_early(str(starter)):
        (early,) = sessions._EARLY
        s = api.load(str(starter), LoadOptions(n_ctx=512))
        assert not sessions._EARLY
    try:
        assert s.child is early  # the load took the started process, warmed for llama.cpp
        assert warmed == ["llama.cpp"]
        assert collect(s, Request.raw("The capital of France is"), GenerationParams(temperature=0, max_tokens=4))[1]
    finally:
        s.close()
    with api.engine_started_early("no-such-model", engine=None):
        (unused,) = sessions._EARLY
    assert warmed == ["llama.cpp"]  # nothing to guess from: no engine warmed
    assert not sessions._EARLY and not _alive(unused.proc.pid)


def test_an_engine_started_early_on_a_wrong_guess_still_loads_the_model(starter: Path) -> None:
    from localrun.backends import session as sessions

    with sessions.early_worker(lambda: "mlx"):  # warming an engine that is not the model's (or not installed)
        s = api.load(str(starter), LoadOptions(n_ctx=512))
    try:
        assert s.info()["engine"] == "llama.cpp"
        text, last = collect(s, Request.raw("The capital of France is"), GenerationParams(temperature=0, max_tokens=4))
        assert last.completion_tokens == 4
    finally:
        s.close()
