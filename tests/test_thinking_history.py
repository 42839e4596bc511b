"""Earlier turns' thoughts in a conversation that goes on: an assistant message keeps its thought
apart (Message.thinking, from Ollama's message.thinking or OpenAI's reasoning_content), and the
template gets it under its reasoning format's history field, so it keeps or drops it as its
authors wrote it. Real templates (llama.cpp's collection), transformers' renderer for parity, and
the tiny random Qwen3 with the real Qwen3 tokenizer through `localrun serve`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.chat import Message, parse_messages, render_template
from localrun.errors import BadModelFileError, UsageError
from localrun.generation import Request
from localrun.reasoning import detect
from tests.server.conftest import Served, serve
from tests.test_reasoning import templates
from tests.thinking_models import TEMPLATE, TOKENIZER

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
# A finished exchange, then a new question: templates drop the earlier turn's thought.
TURNS: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "thinking": "EARLIER-THOUGHT"},
         {"role": "user", "content": "Again"}]
# A call still being answered (after the last user turn): templates that keep thoughts keep this one.
CALLING: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": "", "thinking": "CALL-THOUGHT", "tool_calls": [CALL]},
           {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]


def render(name: str, conversation: list[dict[str, Any]], **kw: Any) -> str:
    source = templates()[name]
    fmt = detect(source)
    assert fmt is not None, name
    return render_template(source, parse_messages(conversation), history_field=fmt.history_field, tools=TOOLS, **kw)


def test_parse_takes_the_thought_from_both_apis_on_assistant_turns_only() -> None:
    ollama, openai, user = parse_messages([
        {"role": "assistant", "content": "A", "thinking": "T1"},
        {"role": "assistant", "content": "B", "reasoning_content": "T2"},
        {"role": "user", "content": "C", "thinking": "ignored"},
    ])
    assert (ollama.thinking, openai.thinking, user.thinking) == ("T1", "T2", "")
    with pytest.raises(UsageError, match="message 0: thinking must be a string"):
        parse_messages([{"role": "assistant", "content": "A", "thinking": ["x"]}])


def test_the_thought_crosses_to_the_worker() -> None:
    request = Request.chat(TURNS)
    assert Request.from_dict(request.to_dict()).messages[1].thinking == "EARLIER-THOUGHT"


def test_without_a_history_field_the_thought_is_left_out() -> None:
    m = Message("assistant", "A", thinking="T")
    assert "thinking" not in m.to_dict(None) and m.to_dict("reasoning_content")["reasoning_content"] == "T"


@pytest.mark.parametrize(("name", "field", "shown"), [
    # Templates that read reasoning_content: the earlier turn's thought is dropped, the call's kept.
    ("Qwen-Qwen3-0.6B", "reasoning_content", "<think>\nCALL-THOUGHT\n</think>"),
    ("Qwen3.5-4B", "reasoning_content", "<think>\nCALL-THOUGHT\n</think>"),
    ("GLM-4.6", "reasoning_content", "<think>CALL-THOUGHT</think>"),
    ("MiniMax-M2", "reasoning_content", "CALL-THOUGHT"),
    # gpt-oss reads message.thinking and writes it on the analysis channel before the call.
    ("openai-gpt-oss-120b", "thinking", "<|channel|>analysis<|message|>CALL-THOUGHT<|end|>"),
    # Templates that never show an earlier thought: dropped everywhere.
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", None, None),
    ("deepseek-ai-DeepSeek-V3.1", None, None),
    ("HuggingFaceTB-SmolLM3-3B", None, None),
    ("ibm-granite-granite-3.3-2B-Instruct", None, None),
    ("mistralai-Ministral-3-14B-Reasoning-2512", None, None),
])
def test_each_template_keeps_or_drops_earlier_thoughts_as_written(name: str, field: str | None,
                                                                  shown: str | None) -> None:
    fmt = detect(templates()[name])
    assert fmt is not None and fmt.history_field == field
    turns = render(name, TURNS)
    assert "EARLIER-THOUGHT" not in turns and "Hello!" in turns
    calling = render(name, CALLING)
    if shown is None:
        assert "CALL-THOUGHT" not in calling
    else:
        assert shown in calling
        # Without the thought the same conversation renders without it: the field is what it reads.
        assert shown not in render(name, [{k: v for k, v in m.items() if k != "thinking"} for m in CALLING])


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "GLM-4.6", "openai-gpt-oss-120b"])
def test_the_last_assistant_turn_keeps_its_thought(name: str) -> None:
    last = render(name, TURNS[:2], add_generation_prompt=False)
    assert "EARLIER-THOUGHT" in last and last.index("EARLIER-THOUGHT") < last.index("Hello!")


@pytest.mark.parametrize("name", ["Qwen-Qwen3-0.6B", "GLM-4.6", "openai-gpt-oss-120b", "Qwen3.5-4B"])
@pytest.mark.parametrize("conversation", [TURNS, CALLING, TURNS[:2]], ids=["turns", "calling", "last"])
def test_transformers_renders_the_same(name: str, conversation: list[dict[str, Any]]) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    source = templates()[name]
    fmt = detect(source)
    assert fmt is not None and fmt.history_field
    wire = [m.to_dict(fmt.history_field) for m in parse_messages(conversation)]
    last = conversation is not TURNS and conversation is not CALLING
    ours = render(name, conversation, add_generation_prompt=not last)
    theirs = render_jinja_template([wire], tools=list[Any](TOOLS), chat_template=source, add_generation_prompt=not last)[0][0]
    if name == "openai-gpt-oss-120b":  # its system block carries today's date
        ours, theirs = ours.split("<|end|>", 1)[1], theirs.split("<|end|>", 1)[1]
    assert ours == theirs


@pytest.mark.parametrize("conversation", [TURNS, CALLING, TURNS[:2]], ids=["turns", "calling", "last"])
def test_every_thinking_template_renders_as_transformers_does(conversation: list[dict[str, Any]]) -> None:
    """Every template of llama.cpp's collection that has a reasoning format, with thinking on, off
    and left to the template, renders a conversation with an earlier thought (and tools) exactly
    as transformers does (in its mutable sandbox: Kimi K2's templates change lists). Among them
    LFM2.5-8B and the three Laguna templates use transformers' {% generation %} block."""
    from tests.test_chat import _mutable_reference

    last = conversation is not TURNS and conversation is not CALLING
    kw: dict[str, Any] = {"add_generation_prompt": not last, "bos_token": "<s>", "eos_token": "</s>"}
    checked, differ, failing = 0, [], set()
    for name, source in sorted(templates().items()):
        fmt = detect(source)
        if fmt is None:
            continue
        wire = [m.to_dict(fmt.history_field) for m in parse_messages(conversation)]
        for think in (None, True, False):
            switch = fmt.switch(think)
            if switch.system_flag:  # SmolLM3's /think in a system turn: the same render with one more turn
                continue
            variables = dict(switch.variables)
            checked += 1
            try:
                theirs = _mutable_reference(source, wire, tools=list[Any](TOOLS), **kw, **variables)
            except Exception:  # noqa: BLE001 (llama.cpp's own test template for R1 fails in tojson)
                with pytest.raises(BadModelFileError, match="chat template failed"):
                    render_template(source, parse_messages(conversation), history_field=fmt.history_field,
                                    tools=TOOLS, **kw, **variables)
                failing.add(name)
                continue
            ours = render_template(source, parse_messages(conversation), history_field=fmt.history_field,
                                   tools=TOOLS, **kw, **variables)
            if ours != theirs:
                differ.append((name, think))
    assert checked >= 120 and not differ, differ
    assert failing <= {"llama-cpp-deepseek-r1"}, failing


# -- through the server, on the tiny Qwen3 with the real Qwen3 template and tokenizer ---------------


@pytest.fixture
def served(thinker: Callable[..., Path]) -> Iterator[Served]:
    api.add_model(thinker(), "qwen3:tiny")
    with serve() as s:
        yield s


def expected_prompt_tokens(conversation: list[dict[str, Any]]) -> int:
    """The prompt's length as the Qwen3 template and tokenizer make it (the thought in
    reasoning_content, which Qwen3's template reads)."""
    from tokenizers import Tokenizer

    text = render_template(TEMPLATE.read_text(), parse_messages(conversation), history_field="reasoning_content",
                           tools=TOOLS)
    return len(Tokenizer.from_file(str(TOKENIZER / "tokenizer.json")).encode(text, add_special_tokens=False).ids)


def test_ollama_message_thinking_reaches_the_template(served: Served) -> None:
    client = served.ollama()
    options = {"num_predict": 1, "temperature": 0}
    plain = [{k: v for k, v in m.items() if k != "thinking"} for m in CALLING]

    def count(messages: list[dict[str, Any]]) -> int:
        return int(client.chat(model="qwen3:tiny", messages=messages, tools=TOOLS, options=options).prompt_eval_count)

    kept, without = count(CALLING), count(plain)
    assert kept == expected_prompt_tokens(CALLING) and without == expected_prompt_tokens(plain)
    assert kept > without  # the call's thought is in the prompt
    # An earlier turn's thought is dropped by Qwen3's template: the prompt is the same with or without.
    assert count(TURNS) == count([{k: v for k, v in m.items() if k != "thinking"} for m in TURNS])


def test_openai_reasoning_content_reaches_the_template(served: Served) -> None:
    client = served.openai()
    wire = [{**{k: v for k, v in m.items() if k != "thinking"}, **({"reasoning_content": m["thinking"]}
                                                                   if "thinking" in m else {})} for m in CALLING]
    for m in wire:
        if "tool_calls" in m:
            m["tool_calls"] = [{**CALL, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    out = client.chat.completions.create(model="qwen3:tiny", messages=wire, tools=TOOLS, max_tokens=1,
                                         temperature=0)
    assert out.usage.prompt_tokens == expected_prompt_tokens(CALLING)
