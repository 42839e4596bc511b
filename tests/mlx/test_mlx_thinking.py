"""Thinking on the MLX engine: the tiny random Qwen3 of tests/thinking_models.py (the real Qwen3
tokenizer, Qwen3's and DeepSeek-R1's templates) converted to MLX by mlx-lm, run through the shared
engine loop. The same parser, switches and budget as on llama.cpp."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun.backends.loop import InProcess
from localrun.backends.mlx import MLXEngine
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from localrun.store import Store
from tests.mlx.conftest import mlx_lm_convert
from tests.thinking_models import R1_TEMPLATE, TEMPLATE, make_thinker

pytest.importorskip("mlx_lm")

# The thought and the answer, held to a grammar from the first token (as in test_thinking_engine).
DRIVE = 'start: <<special:<think>>> /[a-z ]{0,%d}/ <<special:</think>>> /\\n{0,2}/ "Answer."'
SAMPLED = {"temperature": 1.0, "seed": 3}


def _mlx(folder: Path, template: Path) -> Path:
    make_thinker(folder, template=template)  # the Hugging Face checkpoint is kept beside the GGUF
    return mlx_lm_convert(folder / f"tiny-{template.stem}", folder / f"tiny-{template.stem}-mlx")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("mlx-thinkers")
    return {"qwen3": _mlx(folder, TEMPLATE), "r1": _mlx(folder, R1_TEMPLATE)}


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


def ask(think: bool | str | None = None) -> Request:
    return Request.chat([{"role": "user", "content": "Why is the sky blue?"}], think=think)


def run(ip: InProcess, request: Request, **params: object) -> tuple[list[Chunk], str, str]:
    chunks = list(ip.stream(request, GenerationParams(**{"temperature": 0.0, **params})))  # type: ignore[arg-type]
    return chunks, "".join(c.thinking for c in chunks), "".join(c.text for c in chunks)


def prompt(ip: InProcess, request: Request) -> str:
    detok = ip.engine.detokenizer(True)
    return "".join(detok.feed(t) for t in ip.tokenize(request)) + detok.flush()


def test_the_format_comes_from_the_template(qwen3: InProcess, r1: InProcess) -> None:
    assert qwen3.engine.reasoning is not None and qwen3.engine.reasoning.name == "think"
    assert r1.engine.reasoning is not None and r1.engine.reasoning.name == "think"


def test_think_off_renders_the_switch(qwen3: InProcess) -> None:
    assert prompt(qwen3, ask(False)).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(qwen3, ask(True)).endswith("<|im_start|>assistant\n")
    kw = Request.chat([{"role": "user", "content": "hi"}], think=True, template_kwargs={"enable_thinking": False})
    assert prompt(qwen3, kw).endswith("<think>\n\n</think>\n\n")


def test_thought_and_answer_stream_apart_and_no_marker_leaks(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 40, max_tokens=80)
    final = chunks[-1]
    assert final.finish_reason == "stop"
    assert answer == "Answer."
    assert thinking and set(thinking) <= set("abcdefghijklmnopqrstuvwxyz ")
    assert 0 < final.thinking_tokens <= final.completion_tokens
    first_answer = next(i for i, c in enumerate(chunks) if c.text)
    assert not any(c.thinking for c in chunks[first_answer:])
    for c in chunks:
        assert "<" not in c.text + c.thinking and ">" not in c.text + c.thinking


def test_a_reply_cut_inside_its_thought_says_length(qwen3: InProcess) -> None:
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE.replace("{0,%d}", "{30,40}"), max_tokens=6)
    assert chunks[-1].finish_reason == "length"
    assert thinking and answer == ""
    assert chunks[-1].thinking_tokens == 5  # the opening marker, then five tokens inside


@pytest.mark.parametrize("budget", [0, 1, 3, 7])
def test_the_budget_ends_the_thought_and_the_answer_follows(qwen3: InProcess, budget: int) -> None:
    # mlx-lm's BatchGenerator samples one token ahead of the one it hands out: the closing marker
    # must still come right after the budget's last token, never one later.
    chunks, thinking, answer = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120, think_budget=budget)
    final = chunks[-1]
    assert final.finish_reason == "stop" and answer == "Answer."
    assert final.thinking_tokens == budget
    assert len(qwen3.engine.text_tokens(thinking)) <= budget
    free = run(qwen3, ask(False), grammar=DRIVE % 200, max_tokens=120)[0][-1]
    assert free.thinking_tokens > budget


@pytest.mark.parametrize("budget", [1, 10])
def test_a_prompt_that_opens_the_thought_streams_thinking_first(r1: InProcess, budget: int) -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": the random model's reply is thought
    # until the budget inserts </think>, then answer.
    assert prompt(r1, ask()).endswith("<think>\n")
    chunks, thinking, answer = run(r1, ask(), max_tokens=40, think_budget=budget, **SAMPLED)
    final = chunks[-1]
    assert thinking and final.thinking_tokens == budget
    assert answer and "</think>" not in answer
    cut, thinking, answer = run(r1, ask(), max_tokens=8, **SAMPLED)
    assert cut[-1].finish_reason == "length" and thinking and answer == "" and cut[-1].thinking_tokens == 8


def test_an_earlier_call_s_thought_reaches_the_template(qwen3: InProcess) -> None:
    # Qwen3's template reads reasoning_content: a call still being answered keeps its thought.
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    calling = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "thinking": "CALL-THOUGHT", "tool_calls": [call]},
               {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    assert "<think>\nCALL-THOUGHT\n</think>" in prompt(qwen3, Request.chat(calling))
    done = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "EARLIER"},
            {"role": "user", "content": "Again"}]
    assert "EARLIER" not in prompt(qwen3, Request.chat(done))
