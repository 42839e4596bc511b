"""gpt-oss tool calls (harmony): llama.cpp's own gpt-oss cases with calls, read through the
reasoning splitter and then the ToolStreamer as the engine loop and the server feed them; the
real template rendering a conversation with tools and calls; the call grammar after the analysis."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import pytest

from localrun import tools
from localrun.chat import parse_messages, render_template
from localrun.reasoning import Split, detect
from localrun.tools.stream import assemble
from tests.test_reasoning import templates
from tests.test_tools import CONVERSATION, TOOLS, _accepts, _reference, qwen3  # noqa: F401 (a fixture)

GPT_OSS = "openai-gpt-oss-120b"
THOUGHT = "I'm\nthinking"
EDIT_ARGS = {"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": False}


class Case(NamedTuple):
    line: int  # where the case is in llama.cpp's tests/test-chat.cpp (llama-cpp-python 0.3.36)
    raw: str
    thinking: str
    content: str
    calls: list[tuple[str, dict[str, Any]]]


CASES = [
    Case(6457, ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "",
         [("special_function", {"arg1": 1})]),
    Case(6464, '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "",
         [("special_function", {"arg1": 1})]),
    Case(6471, ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "",
         [("special_function", {"arg1": 1})]),
    Case(6478, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "",
         [("special_function", {"arg1": 1})]),
    Case(6485, f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.special_function"
               '<|channel|>analysis<|message|>{"arg1": 1}', THOUGHT, "", [("special_function", {"arg1": 1})]),
    Case(6494, "<|channel|>analysis<|message|>Thinking about edit...<|end|><|start|>assistant<|channel|>commentary "
               f"to=functions.edit <|constrain|>json<|message|>{json.dumps(EDIT_ARGS)}",
         "Thinking about edit...", "", [("edit", EDIT_ARGS)]),
    # built-in tools the request did not offer: llama.cpp drops them (empty content, no call)
    Case(6547, "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant "
               "to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
         "I will execute python to say hello", "", []),
    Case(6556, "<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>assistant"
               '<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
         "I will execute python to say hello", "", []),
    # the same, as the model ends a call message (the template's own header, and <|call|>)
    Case(0, f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Zürich"}<|call|>', THOUGHT, "",
         [("get_weather", {"city": "Zürich"})]),
    Case(0, "<|channel|>final<|message|>Hello, world!\nWhat's up?<|return|>", "", "Hello, world!\nWhat's up?", []),
    # a header addressed to the assistant itself is no call: the channel after it says what it is
    Case(6567, "<|channel|>commentary to=assistant<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
               "<|channel|>final<|message|>Hello, world!\nWhat's up?", THOUGHT, "Hello, world!\nWhat's up?", []),
    Case(6576, "<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>commentary to=assistant"
               "<|channel|>final<|message|>Hello, world!\nWhat's up?", THOUGHT, "Hello, world!\nWhat's up?", []),
]


@pytest.fixture(scope="module")
def gpt_oss() -> str:
    return templates()[GPT_OSS]


def _through(template: str, pieces: list[str]) -> tuple[Split, str, list[tools.ToolCall]]:
    """The reply fed as the engine loop feeds it: the reasoning splitter, then answer + calls
    text into the family's ToolStreamer; no piece may leak harmony markup into the content."""
    splitter = detect(template).splitter()  # type: ignore[union-attr]
    streamer = tools.detect_format(template).streamer()
    split, events = Split(), []
    for p in pieces:
        part = splitter.feed(p)
        split += part
        events += streamer.feed(part.answer + part.calls)
    part = splitter.flush()
    split += part
    events += streamer.feed(part.answer + part.calls) + streamer.flush()
    content, calls = assemble(events)
    assert "<|" not in content
    return split, content, calls


def test_gpt_oss_is_the_harmony_tool_family(gpt_oss: str) -> None:
    fmt = tools.detect_format(gpt_oss)
    assert fmt.name == "harmony" and fmt.native
    assert all(tools.detect_format(t).name != "harmony" for name, t in templates().items()
               if "<|channel|>" not in t)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"line{c.line}")
@pytest.mark.parametrize("cut", ["whole", "chars"])
def test_llama_cpp_gpt_oss_calls_agree(gpt_oss: str, case: Case, cut: str) -> None:
    split, content, calls = _through(gpt_oss, [case.raw] if cut == "whole" else list(case.raw))
    assert split.thinking == case.thinking
    assert content == case.content
    assert [(c.name, c.arguments) for c in calls] == case.calls
    # the whole-reply parse (run --json, batch, non-streamed replies) agrees with the stream
    whole_content, whole_calls = tools.detect_format(gpt_oss).parse(split.answer + split.calls)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (case.content, case.calls)


def test_a_broken_call_body_is_no_call(gpt_oss: str) -> None:
    fmt = tools.detect_format(gpt_oss)
    content, calls = fmt.parse('<|channel|>commentary to=functions.get_weather<|message|>{"city": ')
    assert calls == [] and "get_weather" not in content


def test_the_template_renders_tools_and_calls_as_transformers_does(gpt_oss: str) -> None:
    fmt = tools.detect_format(gpt_oss)
    two = [*CONVERSATION[:2], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        {"role": "tool", "tool_call_id": "c2", "content": '"noon"'}]
    prepared = fmt.prepare(parse_messages(two), TOOLS)
    assert [len(m.tool_calls) for m in prepared if m.role == "assistant"] == [1, 1]
    kw: dict[str, Any] = {"add_generation_prompt": True, "tools": TOOLS}
    ours = render_template(gpt_oss, prepared, **kw)
    assert ours == _reference(gpt_oss, [m.to_dict() for m in prepared], **kw)
    assert "type get_weather = (_: {" in ours and "City, e.g. Zürich" in ours
    # both calls are in the prompt, each as its own message in the model's own syntax
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
            '{"city": "Zürich"}<|call|>') in ours
    assert "to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>" in ours
    assert ours.endswith("<|start|>assistant")
    # and what the model writes after that prompt parses back into the call
    _, content, calls = _through(gpt_oss, [' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'])
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_time", {})]


def test_a_forced_call_applies_after_the_analysis(gpt_oss: str, request: pytest.FixtureRequest) -> None:
    """Under tool_choice required the model may still write its analysis; the grammar then holds
    the call message (the harmony markers are text in this vocabulary: the grammar's literals)."""
    tok, lookup = request.getfixturevalue("qwen3")
    fmt = tools.detect_format(gpt_oss)
    required = fmt.grammar(TOOLS, "required")
    assert required is not None
    call = ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Zürich", "days": 3}'
    analysis = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
    assert _accepts(tok, lookup, required, analysis + call)
    assert _accepts(tok, lookup, required, call)
    assert not _accepts(tok, lookup, required, analysis + call.replace('"days": 3', '"days": "3"'))
    assert not _accepts(tok, lookup, required, "<|channel|>final<|message|>It is sunny.")
    named = fmt.grammar(TOOLS, "get_time")
    assert named is not None and not _accepts(tok, lookup, named, analysis + call)
    assert _accepts(tok, lookup, named, analysis + " to=functions.get_time<|channel|>commentary json<|message|>{}")
    lazy, trigger = fmt.constraint(TOOLS, "auto") or ("", None)
    assert trigger == "to=functions." and _accepts(tok, lookup, lazy, call[call.index(trigger):])

