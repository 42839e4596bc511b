"""Ollama's num_ctx (and localrun's kv_cache_type) per request: the pool loads an instance with
the context asked for beside the server's default one, a smaller num_ctx reuses a loaded
instance, and a prompt that does not fit the context is a 400 on every API, never truncated."""

from __future__ import annotations

from collections.abc import Iterator

import ollama
import openai
import pytest

from localrun.settings import LoadOptions

from .conftest import MODEL, Served, serve

DEFAULT = 256  # the server's --ctx
ASKED = 512  # a client's num_ctx
# About 360 tokens with the chat template: over the default context, within num_ctx.
MIDDLE = "hot cold " * 160 + "\nWhat is the opposite of hot?"
LONG = "hot cold " * 300  # over num_ctx


@pytest.fixture(scope="module")
def two_slots() -> Iterator[Served]:
    """A server whose default context is 256 tokens, with room for two loaded instances."""
    with serve(LoadOptions(n_ctx=DEFAULT, n_parallel=1), max_loaded=2) as s:
        yield s


def _instances(served: Served) -> list[tuple[str, int, str]]:
    """(model, context, KV-cache type) of each loaded instance, as /api/ps reports them."""
    models = served.http().get("/api/ps").json()["models"]
    assert [m.context_length for m in served.ollama().ps().models] == [m["context_length"] for m in models]
    return sorted((m["model"], m["context_length"], m["kv_cache_type"]) for m in models)


def _chat(served: Served, text: str, **options: object) -> ollama.ChatResponse:
    return served.ollama().chat(model=MODEL, messages=[{"role": "user", "content": text}],
                                options={"temperature": 0, "num_predict": 2, **options})


def _is_400(call: object, error: type[Exception], holds: int) -> None:
    with pytest.raises(error) as e:
        call()  # type: ignore[operator]
    status = getattr(e.value, "status_code", None)
    assert status == 400, e.value
    assert f"but the context holds {holds}" in str(e.value)


def test_num_ctx_loads_an_instance_with_that_context(two_slots: Served) -> None:
    s = two_slots
    # On the server's default context the prompt does not fit: a 400 on each API, not a truncation.
    _is_400(lambda: _chat(s, MIDDLE), ollama.ResponseError, DEFAULT)
    _is_400(lambda: s.ollama().generate(model=MODEL, prompt=MIDDLE, options={"num_predict": 2}),
            ollama.ResponseError, DEFAULT)
    _is_400(lambda: s.openai().chat.completions.create(model=MODEL, max_tokens=2,
                                                         messages=[{"role": "user", "content": MIDDLE}]),
            openai.BadRequestError, DEFAULT)
    assert _instances(s) == [(MODEL, DEFAULT, "f16")]

    out = _chat(s, MIDDLE, num_ctx=ASKED, num_predict=8)
    assert DEFAULT < (out.prompt_eval_count or 0) < ASKED and "cold" in (out.message.content or "").lower()
    assert _instances(s) == [(MODEL, DEFAULT, "f16"), (MODEL, ASKED, "f16")]

    # Past num_ctx: a 400 on both Ollama endpoints, with the context the instance holds.
    _is_400(lambda: _chat(s, LONG, num_ctx=ASKED), ollama.ResponseError, ASKED)
    _is_400(lambda: s.ollama().generate(model=MODEL, prompt=LONG, options={"num_predict": 2, "num_ctx": ASKED}),
            ollama.ResponseError, ASKED)

    # A smaller num_ctx is served by a loaded instance: nothing new loads.
    assert _chat(s, "What is the opposite of hot?", num_ctx=128).done
    assert _instances(s) == [(MODEL, DEFAULT, "f16"), (MODEL, ASKED, "f16")]


def test_kv_cache_type_gets_an_instance_of_its_own(two_slots: Served) -> None:
    s = two_slots
    out = _chat(s, "What is the opposite of hot?", kv_cache_type="q8_0", num_predict=8)
    assert "cold" in (out.message.content or "").lower()
    loaded = _instances(s)
    assert (MODEL, DEFAULT, "q8_0") in loaded and len(loaded) == 2  # the one idle longest made room
    r = s.http().post("/api/chat", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                        "options": {"kv_cache_type": "q3_k"}})
    assert r.status_code == 400 and "kv_cache_type" in r.text
