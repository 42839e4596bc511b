"""Thinking through the engine loop on the real llama.cpp engine: a tiny random Qwen3 with the real
Qwen3 tokenizer and chat templates (Qwen3's, DeepSeek-R1's), driven by grammars to think."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localrun import api
from localrun.backends.llama_cpp import LlamaCppEngine
from localrun.backends.loop import InProcess
from localrun.settings import LoadOptions
from tests.thinking_models import (
    R1_TEMPLATE,
    SAMPLED,
    ask,
    check_a_cut_thought,
    check_a_prompt_that_opens_the_thought,
    check_the_budget,
    check_the_switch_reaches_the_template,
    check_thought_and_answer_stream_apart,
    run,
)


@pytest.fixture(scope="module")
def models(thinker: Callable[..., Path]) -> dict[str, Path]:
    return {"qwen3": thinker(), "r1": thinker(R1_TEMPLATE)}


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


def test_the_format_comes_from_the_template_and_vocabulary(qwen3: InProcess, r1: InProcess) -> None:
    assert qwen3.engine.reasoning is not None and qwen3.engine.reasoning.name == "think"
    assert r1.engine.reasoning is not None and r1.engine.reasoning.name == "think"
    starter = LlamaCppEngine(api.get_model("smollm2:135m"), LoadOptions(n_ctx=256))
    try:
        assert starter.reasoning is None
    finally:
        starter.close()


def test_the_switch_reaches_the_template(qwen3: InProcess) -> None:
    check_the_switch_reaches_the_template(qwen3)


def test_thought_and_answer_stream_apart_and_no_marker_leaks(qwen3: InProcess) -> None:
    check_thought_and_answer_stream_apart(qwen3)


def test_a_reply_cut_inside_its_thought_says_length_and_keeps_the_thought_apart(qwen3: InProcess) -> None:
    check_a_cut_thought(qwen3)


@pytest.mark.parametrize("budget", [0, 3, 7])
def test_the_budget_ends_the_thought_and_the_answer_follows(qwen3: InProcess, budget: int) -> None:
    check_the_budget(qwen3, budget)


def test_a_prompt_that_opens_the_thought_streams_thinking_first(r1: InProcess) -> None:
    check_a_prompt_that_opens_the_thought(r1, 10)


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


def test_an_answer_follows_the_thought_within_the_reply_s_budget(qwen3: InProcess) -> None:
    """After its thought the grammar allows only a little whitespace: unbounded, sampled replies
    spent their whole max_tokens on whitespace after </think> and ended with no answer (3 of these
    8 seeds did)."""
    from localrun.constraint import Constraint

    choice = Constraint.choice(["yes", "plain"]).grammar
    for seed in range(1, 9):
        chunks, thinking, answer = run(qwen3, ask(True), grammar=choice, max_tokens=30, think_budget=3,
                                       temperature=1.0, seed=seed)
        assert chunks[-1].finish_reason == "stop" and answer in ("yes", "plain"), (seed, thinking, answer)
        assert chunks[-1].thinking_tokens <= 3
