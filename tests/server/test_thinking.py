"""Thinking through `localrun serve` with the official clients: ollama-python's think and
message.thinking, openai's reasoning_content, on a tiny random Qwen3 with the real Qwen3 tokenizer
and the DeepSeek-R1 and Qwen3 templates (tests/thinking_models.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from localrun import api
from tests.thinking_models import R1_TEMPLATE

from .conftest import MODEL, Served, serve

# DeepSeek-R1's template opens <think> in the prompt: the random model thinks until the budget
# inserts </think>, then answers. Sampled: greedy, the random model repeats whitespace.
SAMPLED = {"temperature": 1.0, "seed": 3, "num_predict": 40, "think_budget": 8}
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinkers(thinker: Callable[..., Path]) -> dict[str, Path]:
    return {"r1:tiny": thinker(R1_TEMPLATE), "qwen3:tiny": thinker()}


@pytest.fixture
def served(thinkers: dict[str, Path]) -> Iterator[Served]:
    for name, path in thinkers.items():
        api.add_model(path, name)
    with serve() as s:
        yield s


def test_ollama_chat_with_think_returns_the_thought_apart(served: Served) -> None:
    client = served.ollama()
    out = client.chat(model="r1:tiny", messages=ASK, think=True, options=SAMPLED)
    assert out.message.thinking and out.message.content
    assert "</think>" not in out.message.content and "<think>" not in out.message.thinking
    # Streamed, as Ollama sends it: thinking pieces first, then content, in message.thinking / .content.
    parts = list(client.chat(model="r1:tiny", messages=ASK, think=True, options=SAMPLED, stream=True))
    thought = "".join(p.message.thinking or "" for p in parts)
    content = "".join(p.message.content for p in parts)
    assert (thought, content) == (out.message.thinking, out.message.content)
    first_content = next(i for i, p in enumerate(parts) if p.message.content)
    assert not any(p.message.thinking for p in parts[first_content:])
    assert parts[-1].done and parts[-1].done_reason == "length"  # the random answer runs to num_predict
    # /api/generate puts it beside the response.
    gen = client.generate(model="r1:tiny", prompt="Why is the sky blue?", think=True, options=SAMPLED)
    assert gen.thinking and gen.response


def test_think_budget_top_level_ends_the_thought(served: Served) -> None:
    http = served.http()
    options = {k: v for k, v in SAMPLED.items() if k != "think_budget"}
    short = http.post("/api/chat", json={"model": "r1:tiny", "messages": ASK, "think": True, "stream": False,
                                         "think_budget": 2, "options": options}).json()
    long = http.post("/api/chat", json={"model": "r1:tiny", "messages": ASK, "think": True, "stream": False,
                                        "think_budget": 12, "options": options}).json()
    assert 0 < len(short["message"]["thinking"]) < len(long["message"]["thinking"])
    assert short["message"]["content"]


def test_think_on_a_model_that_cannot_is_a_400_naming_it(served: Served) -> None:
    import ollama

    with pytest.raises(ollama.ResponseError) as e:
        served.ollama().chat(model=MODEL, messages=ASK, think=True)
    assert e.value.status_code == 400
    assert f'"{MODEL}" does not support thinking' in e.value.error
    # think false is fine anywhere
    assert served.ollama().chat(model=MODEL, messages=ASK, think=False, options={"num_predict": 2}).message


def test_show_lists_thinking_only_for_models_that_can(served: Served) -> None:
    client = served.ollama()
    assert "thinking" in client.show("r1:tiny").capabilities
    assert "thinking" in client.show("qwen3:tiny").capabilities
    assert "thinking" not in client.show(MODEL).capabilities


def test_openai_reasoning_content_in_the_message_and_the_deltas(served: Served) -> None:
    client = served.openai()
    extra = {"think_budget": 8}
    out = client.chat.completions.create(model="r1:tiny", messages=ASK, temperature=1.0, seed=3, max_tokens=40,
                                         extra_body=extra)
    message = out.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning and message.content and "</think>" not in message.content
    stream = client.chat.completions.create(model="r1:tiny", messages=ASK, temperature=1.0, seed=3, max_tokens=40,
                                            extra_body=extra, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content


def test_openai_completions_keep_the_thought_a_raw_prompt_opened(served: Served) -> None:
    """A raw prompt ending inside a thought: the thought comes back as the choice's
    reasoning_content (whole and streamed), never dropped."""
    client = served.openai()
    args = {"model": "r1:tiny", "prompt": "Why is the sky blue?<think>\n", "temperature": 1.0, "seed": 3,
            "max_tokens": 16}
    choice = client.completions.create(**args).choices[0]
    reasoning = (choice.model_extra or {}).get("reasoning_content")
    assert reasoning and "<think>" not in reasoning
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join((c.model_extra or {}).get("reasoning_content") or "" for c in chunks) == reasoning
    assert "".join(c.text for c in chunks) == choice.text


def test_openai_switches_reach_the_template(served: Served) -> None:
    # Qwen3's template writes an empty, closed thought into the prompt when thinking is off:
    # chat_template_kwargs and reasoning_effort "none" both turn it off (4 more prompt tokens).
    client = served.openai()

    def prompt_tokens(**extra: object) -> int:
        out = client.chat.completions.create(model="qwen3:tiny", messages=ASK, max_tokens=1, extra_body=extra)
        assert out.usage is not None
        return out.usage.prompt_tokens

    on = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == on + 4
    assert prompt_tokens(reasoning_effort="none") == on + 4
    assert prompt_tokens(reasoning_effort="high") == on


@pytest.mark.parametrize("think", [True, False])
@pytest.mark.parametrize("model", ["r1:tiny", "qwen3:tiny"])
def test_format_with_and_without_thinking_gives_valid_json(served: Served, model: str, think: bool) -> None:
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = served.ollama().chat(model=model, messages=ASK, think=think, format=schema,
                               options={**SAMPLED, "num_predict": 60, "think_budget": 4})
    assert json.loads(out.message.content) in ({"ok": True}, {"ok": False})
    if model == "r1:tiny":  # its prompt opened the thought: it thinks either way, up to its budget
        assert out.message.thinking
