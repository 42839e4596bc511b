"""Tool calling through the server with the official clients, on the starter model (whose
template has no tool syntax: the generic format, forced by grammar): tool_choice required, a
named function, auto, none, streamed deltas, Ollama's object arguments, tool results."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .conftest import MODEL, Served

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check(calls: list[dict[str, object]]) -> None:
    assert calls
    for c in calls:
        fn = c["function"]
        assert isinstance(fn, dict)
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_returns_a_call_that_validates(served: Served, seed: int) -> None:
    client = served.openai()
    res = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                         temperature=0.9, seed=seed, max_tokens=120)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [c.model_dump() for c in choice.message.tool_calls]
    _check(calls)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_streamed_call_arrives_as_deltas_that_join_to_the_whole(served: Served) -> None:
    client = served.openai()
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 2 and all(d.index == 0 for d in deltas)
    assert deltas[0].id and deltas[0].function.name == whole.function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_function_auto_none_and_a_tool_result(served: Served) -> None:
    client = served.openai()
    named = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 3 plus 4?"}],
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0, max_tokens=80)
    calls = named.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "add"
    _check([c.model_dump() for c in calls])
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=120)
    msg = auto.choices[0].message
    assert (msg.tool_calls and auto.choices[0].finish_reason == "tool_calls") or (msg.content and not msg.tool_calls)
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=16)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    # The call and its result go back through the template; the model answers in words or calls again.
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": "7"}]
    after = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=60)
    assert after.choices[0].message.content or after.choices[0].message.tool_calls


def test_ollama_tools_give_object_arguments(served: Served) -> None:
    client = served.ollama()
    res = client.chat(model=MODEL, messages=ASK, tools=TOOLS, options={"temperature": 0, "num_predict": 120})
    calls = res.message.tool_calls
    assert calls and calls[0].function.name in SCHEMAS
    jsonschema.validate(dict(calls[0].function.arguments), SCHEMAS[calls[0].function.name])
    parts = list(client.chat(model=MODEL, messages=ASK, tools=TOOLS, stream=True,
                             options={"temperature": 0, "num_predict": 120}))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(c.function.name, dict(c.function.arguments)) for c in calls]
    assert parts[-1].done


def test_bad_tools_are_400(served: Served) -> None:
    client = served.openai()
    # A keyword no grammar enforces is left to the tool to check (agents' tools carry them);
    # a schema that is not one is refused, naming where.
    unique = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                        "uniqueItems": True}}, "required": ["tags"]}
    res = client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", max_tokens=60,
                                         temperature=0, tools=[{"type": "function", "function": {
                                             "name": "f", "parameters": unique}}])
    calls = res.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "f"
    assert isinstance(json.loads(calls[0].function.arguments)["tags"], list)
    with pytest.raises(openai.BadRequestError, match="properties"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}])
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[{"type": "function", "function": {}}])
