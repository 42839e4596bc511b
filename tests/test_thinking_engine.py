"""Thinking through the engine loop on the real llama.cpp engine: a tiny random Qwen3 with the real
Qwen3 tokenizer and chat templates (Qwen3's, DeepSeek-R1's), driven by grammars to think."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun import api
from localrun.backends.llama_cpp import LlamaCppEngine
from localrun.backends.loop import InProcess
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from tests.thinking_models import R1_TEMPLATE, make_thinker

# The thought and the answer, held to a grammar from the first token (thinking off renders an
# already closed thought into the prompt, so the loop leaves the grammar as it is).
DRIVE = 'start: <<special:<think>>> /[a-z ]{0,%d}/ <<special:</think>>> /\\n{0,2}/ "Answer."'
SAMPLED = {"temperature": 1.0, "seed": 3}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("thinkers")
    return {"qwen3": make_thinker(folder), "r1": make_thinker(folder, template=R1_TEMPLATE)}


@pytest.fixture(scope="module")
def qwen3(models: dict[str, Path]) -> Iterator[InProcess]:
    ip = InProcess(LlamaCppEngine(api.get_model(str(models["qwen3"])), LoadOptions(n_ctx=512)))
    yield ip
    ip.close()


@pytest.fixture(scope="module")
def r1(models: dict[str, Path]) -> Iterator[InProcess]:
    ip = InProcess(LlamaCppEngine(api.get_model(str(models["r1"])), LoadOptions(n_ctx=512)))
    yield ip
    ip.close()


def ask(think: bool | str | None = None) -> Request:
    return Request.chat([{"role": "user", "content": "Why is the sky blue?"}], think=think)


def run(ip: InProcess, request: Request, **params: object) -> tuple[list[Chunk], str, str]:
    chunks = list(ip.stream(request, GenerationParams(**{"temperature": 0.0, **params})))  # type: ignore[arg-type]
    return chunks, "".join(c.thinking for c in chunks), "".join(c.text for c in chunks)


def test_the_format_comes_from_the_template_and_vocabulary(qwen3: InProcess, r1: InProcess) -> None:
    assert qwen3.engine.reasoning is not None and qwen3.engine.reasoning.name == "think"
    assert r1.engine.reasoning is not None and r1.engine.reasoning.name == "think"
    starter = LlamaCppEngine(api.get_model("smollm2:135m"), LoadOptions(n_ctx=256))
    try:
        assert starter.reasoning is None
    finally:
        starter.close()


def test_the_switch_reaches_the_template(qwen3: InProcess) -> None:
    detok = qwen3.engine.detokenizer(True)

    def prompt(request: Request) -> str:
        return "".join(detok.feed(t) for t in qwen3.tokenize(request))

    assert prompt(ask(False)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(ask(True)).endswith("<|im_start|>assistant\n")
    # A client's chat_template_kwargs win over the request's switch.
    kw = Request.chat([{"role": "user", "content": "hi"}], think=True, template_kwargs={"enable_thinking": False})
    assert prompt(kw).endswith("<think>\n\n</think>\n\n")


def test_thought_and_answer_stream_apart_and_no_marker_leaks(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 40, max_tokens=80)
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert answer == "Answer."
    assert thinking and set(thinking) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert 0 < final.thinking_tokens <= final.completion_tokens
    # Every thought chunk comes before the first answer chunk; no piece of a marker is in either.
    first_answer = next(i for i, c in enumerate(chunks) if c.text)
    assert not any(c.thinking for c in chunks[first_answer:])
    for c in chunks:
        assert "<" not in c.text + c.thinking and ">" not in c.text + c.thinking


def test_a_reply_cut_inside_its_thought_says_length_and_keeps_the_thought_apart(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE.replace("{0,%d}", "{30,40}"), max_tokens=6)
    assert chunks[-1].finish_reason == "length"
    assert thinking and answer == ""
    assert chunks[-1].thinking_tokens == 5  # the opening marker, then five tokens inside


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_the_budget_ends_the_thought_and_the_answer_follows(qwen3: InProcess, budget: int) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120, think_budget=budget)
    final = chunks[-1]
    assert final.finish_reason == "stop" and answer == "Answer."
    assert final.thinking_tokens == budget
    assert len(qwen3.engine.text_tokens(thinking)) <= budget
    # Without the budget the same reply thinks longer.
    free = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120)[0][-1]
    assert free.thinking_tokens > budget


def test_a_prompt_that_opens_the_thought_streams_thinking_first(r1: InProcess) -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": the random model's reply is thought
    # until the budget inserts </think>, then answer (sampled: greedy, it repeats whitespace).
    chunks, thinking, answer = run(r1, ask(), max_tokens=40, think_budget=10, **SAMPLED)
    final = chunks[-1]
    assert thinking and final.thinking_tokens == 10
    assert answer and "</think>" not in answer
    cut, thinking, answer = run(r1, ask(), max_tokens=8, **SAMPLED)
    assert cut[-1].finish_reason == "length" and thinking and answer == "" and cut[-1].thinking_tokens == 8


def test_a_schema_applies_after_the_thought(r1: InProcess, qwen3: InProcess) -> None:
    import json

    from localrun.constraint import Constraint

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    lark = Constraint.schema(schema).grammar
    # The prompt opened the thought: the model thinks (up to its budget), then the schema holds.
    chunks, thinking, answer = run(r1, ask(), grammar=lark, max_tokens=60, think_budget=6, **SAMPLED)
    assert chunks[-1].finish_reason == "stop"
    assert thinking and chunks[-1].thinking_tokens == 6
    assert json.loads(answer) in ({"ok": True}, {"ok": False})
    # Thinking off: the schema holds from the first token, nothing is thought.
    chunks, thinking, answer = run(qwen3, ask(False), grammar=lark, max_tokens=60)
    assert thinking == "" and json.loads(answer) in ({"ok": True}, {"ok": False})
