"""Thinking on the MLX engine: the tiny random Qwen3 of tests/thinking_models.py (the real Qwen3
tokenizer, Qwen3's and DeepSeek-R1's templates) converted to MLX by mlx-lm, run through the shared
engine loop. The same parser, switches and budget as on llama.cpp: the same checks
(tests/thinking_models.py) as test_thinking_engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localrun.backends.loop import InProcess
from localrun.backends.mlx import MLXEngine
from localrun.generation import Request
from localrun.settings import LoadOptions
from localrun.store import Store
from tests.mlx.conftest import mlx_lm_convert
from tests.test_thinking_history import CALLING, TURNS
from tests.thinking_models import (
    R1_TEMPLATE,
    TEMPLATE,
    check_a_cut_thought,
    check_a_prompt_that_opens_the_thought,
    check_the_budget,
    check_the_switch_reaches_the_template,
    check_thought_and_answer_stream_apart,
    prompt,
)

pytest.importorskip("mlx_lm")


@pytest.fixture(scope="module")
def models(thinker: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mlx-thinkers")
    # The Hugging Face checkpoint the session's thinker kept beside its GGUF, converted by mlx-lm.
    return {name: mlx_lm_convert(thinker(template).with_suffix(""), folder / f"{name}-mlx")
            for name, template in (("qwen3", TEMPLATE), ("r1", R1_TEMPLATE))}


def _open(path: Path) -> InProcess:
    info = Store(path.parent / ".store").get(str(path))
    return InProcess(MLXEngine(info, LoadOptions(n_ctx=512)))


@pytest.fixture(scope="module")
def qwen3(models: dict[str, Path]) -> Iterator[InProcess]:
    ip = _open(models["qwen3"])
    yield ip
    ip.close()


@pytest.fixture(scope="module")
def r1(models: dict[str, Path]) -> Iterator[InProcess]:
    ip = _open(models["r1"])
    yield ip
    ip.close()


def test_the_format_comes_from_the_template(qwen3: InProcess, r1: InProcess) -> None:
    assert qwen3.engine.reasoning is not None and qwen3.engine.reasoning.name == "think"
    assert r1.engine.reasoning is not None and r1.engine.reasoning.name == "think"


def test_think_off_renders_the_switch(qwen3: InProcess) -> None:
    check_the_switch_reaches_the_template(qwen3)


def test_thought_and_answer_stream_apart_and_no_marker_leaks(qwen3: InProcess) -> None:
    check_thought_and_answer_stream_apart(qwen3)


def test_a_reply_cut_inside_its_thought_says_length(qwen3: InProcess) -> None:
    check_a_cut_thought(qwen3)


@pytest.mark.parametrize("budget", [0, 1, 3, 7])
def test_the_budget_ends_the_thought_and_the_answer_follows(qwen3: InProcess, budget: int) -> None:
    # mlx-lm's BatchGenerator samples one token ahead of the one it hands out: the closing marker
    # must still come right after the budget's last token, never one later.
    check_the_budget(qwen3, budget)


@pytest.mark.parametrize("budget", [1, 10])
def test_a_prompt_that_opens_the_thought_streams_thinking_first(r1: InProcess, budget: int) -> None:
    check_a_prompt_that_opens_the_thought(r1, budget)


def test_an_earlier_call_s_thought_reaches_the_template(qwen3: InProcess) -> None:
    # Qwen3's template reads reasoning_content: a call still being answered keeps its thought, a
    # finished turn's is dropped (the conversations of test_thinking_history).
    assert "<think>\nCALL-THOUGHT\n</think>" in prompt(qwen3, Request.chat(CALLING))
    assert "EARLIER" not in prompt(qwen3, Request.chat(TURNS))
