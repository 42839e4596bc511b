"""The Responses API through the official openai client and the OpenAI Agents SDK, on the starter
model and a tiny thinking Qwen3: replies whole and streamed (each event checked against the types
the openai package ships), function and freeform tools forced by grammar (a forced apply_patch
is applied by Codex's own apply_patch), stored responses and previous_response_id, reasoning items
that round-trip, token counts, zstd bodies, cancellation and a prompt past the context."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from pydantic import TypeAdapter

from localrun import api
from localrun.settings import LoadOptions
from tests.agents import apply_patch
from tests.thinking_models import R1_TEMPLATE, TEMPLATE

from .codex_capture import codex_request
from .conftest import MODEL, Served, serve, sse

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
EXAMPLE = ("You edit files with the apply_patch tool. Example: to create the file hello.txt containing the line "
           "hello world, call apply_patch with:\n*** Begin Patch\n*** Add File: hello.txt\n+hello world\n*** End Patch")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(LoadOptions(n_ctx=2048, n_parallel=2)) as s:
        yield s


def _events(served: Served, body: dict[str, Any]) -> list[Any]:
    """A streamed response's events, each parsed by the openai package's own event types."""
    from openai.types.responses import ResponseStreamEvent

    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    out = []
    for data in sse(served, "/v1/responses", body):
        error = (data.get("response") or {}).get("error") or {}
        if error.get("code") == "context_length_exceeded":
            # What OpenAI sends and Codex acts on, which the package's list of codes omits
            data = {**data, "response": {**data["response"], "error": {**error, "code": "server_error"}}}
            out.append(adapter.validate_python(data))
            out[-1].response.error.code = "context_length_exceeded"
        else:
            out.append(adapter.validate_python(data))
    return out


def test_a_reply_whole_and_streamed(served: Served) -> None:
    client = served.openai()
    whole = client.responses.create(model=MODEL, input="What is the opposite of hot?", temperature=0,
                                    max_output_tokens=40)
    assert whole.status in ("completed", "incomplete") and "cold" in whole.output_text.lower()
    assert whole.usage is not None and whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    events = _events(served, {"model": MODEL, "input": "What is the opposite of hot?", "temperature": 0,
                              "max_output_tokens": 40})
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert len(deltas) > 3  # the text arrives as it is generated
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[deltas[-1] + 1:] == [*tail, f"response.{whole.status}"]
    final = events[-1].response
    assert "".join(events[i].delta for i in deltas) == final.output_text == whole.output_text  # greedy: the same
    assert events[deltas[-1] + 1].text == final.output_text
    assert final.id != whole.id and final.usage.output_tokens == whole.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(served: Served) -> None:
    events = _events(served, {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 5})
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 5


def test_a_forced_function_call_round_trips(served: Served) -> None:
    client = served.openai()
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees"}]
    again = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, input=result)
    assert again.previous_response_id == first.id and again.output[0].type == "function_call"
    # the first turn (prompt and call) was found in the KV cache, not evaluated again
    assert again.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    answer = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=30, tool_choice="none", input=result)
    assert answer.output_text and answer.output[0].type == "message"
    streamed = _events(served, {"model": MODEL, "input": "Weather in Rome?", "tools": [WEATHER],
                                "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0})
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    added = next(e for e in streamed if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and json.loads(done.arguments)["city"]


def test_a_forced_apply_patch_is_one_codex_applies(served: Served, tmp_path: Path) -> None:
    """Codex's own apply_patch tool (a custom tool with its Lark grammar, as Codex sends it): forced,
    its input follows the grammar, and Codex's apply_patch applies it. A tiny model that rambles is
    cut by max_output_tokens and the patch is still closed, so it still applies."""
    tool = next(t for t in codex_request()["tools"] if t.get("name") == "apply_patch")
    assert tool["type"] == "custom" and tool["format"]["syntax"] == "lark"
    client = served.openai()
    for budget in (400, 60):
        reply = client.responses.create(model=MODEL, instructions=EXAMPLE, input="Create notes.txt with buy milk",
                                        tools=[tool], tool_choice={"type": "custom", "name": "apply_patch"},
                                        temperature=0, max_output_tokens=budget)
        (call,) = [o for o in reply.output if o.type == "custom_tool_call"]
        repo = tmp_path / f"repo{budget}"
        repo.mkdir()
        applied = apply_patch(call.input, repo)
        assert applied.returncode == 0, (call.input, applied.stderr)
        assert any(p.is_file() for p in repo.rglob("*")), call.input
    events = _events(served, {"model": MODEL, "instructions": EXAMPLE, "input": "Create a.txt with hi",
                              "tools": [tool], "tool_choice": {"type": "custom", "name": "apply_patch"},
                              "temperature": 0, "max_output_tokens": 200})
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert deltas == done.input and done.input.startswith("*** Begin Patch\n")


def test_stored_responses_and_previous_response_id(served: Served) -> None:
    client = served.openai()
    first = client.responses.create(model=MODEL, input="My name is Ada. What is my name?", temperature=0,
                                    max_output_tokens=20, metadata={"k": "v"})
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text and again.metadata == {"k": "v"}
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="Say it again.",
                                     temperature=0, max_output_tokens=20)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=first.id, input="again")
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_input_tokens_counts_what_create_evaluates(served: Served) -> None:
    client = served.openai()
    body = {"model": MODEL, "instructions": "Be brief.", "input": "Name a color.", "tools": [WEATHER]}
    counted = client.responses.input_tokens.count(**body)
    made = client.responses.create(**body, max_output_tokens=2, temperature=0)
    assert counted.input_tokens == made.usage.input_tokens > 0


def test_zstd_bodies_as_codex_sends_them(served: Served) -> None:
    import zstandard

    body = json.dumps({"model": MODEL, "input": "hi", "max_output_tokens": 3}).encode()
    res = served.http().post("/v1/responses", content=zstandard.ZstdCompressor().compress(body),
                             headers={"content-encoding": "zstd", "content-type": "application/json"})
    assert res.status_code == 200 and res.json()["usage"]["output_tokens"] == 3
    bad = served.http().post("/v1/responses", content=b"\x28\xb5\x2f\xfdnot zstd",
                             headers={"content-encoding": "zstd"})
    assert bad.status_code == 400 and "zstd" in bad.json()["error"]["message"]


def test_a_prompt_past_the_context_is_context_length_exceeded(served: Served) -> None:
    client = served.openai()
    long = "word " * 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input=long)
    assert e.value.code == "context_length_exceeded"
    events = _events(served, {"model": MODEL, "input": long})
    assert [e.type for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[2].code == "context_length_exceeded" == events[3].response.error.code


def test_fields_it_cannot_honour_are_refused_by_name(served: Served) -> None:
    client = served.openai()
    for field, value in (("background", True), ("truncation", "auto"), ("conversation", "conv_1")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", extra_body={field: value})
        assert field in str(e.value), field
    ok = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, truncation="disabled", user="u",
                                 service_tier="auto", prompt_cache_key="k", safety_identifier="s",
                                 tools=[{"type": "web_search"}, WEATHER], include=["reasoning.encrypted_content"])
    assert ok.status in ("completed", "incomplete")


def test_cancel_stops_a_response_being_generated(served: Served) -> None:
    http = served.http()
    started = threading.Event()
    seen: list[str] = []

    def read() -> None:
        with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Tell me a long story.",
                                                        "stream": True, "max_output_tokens": 400}) as res:
            for line in res.iter_lines():
                if line.startswith("data: "):
                    data = json.loads(line[6:])
                    seen.append(data)
                    if data["type"] == "response.output_text.delta":
                        started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(120)
    rid = seen[0]["response"]["id"]
    cancelled = http.post(f"/v1/responses/{rid}/cancel").json()
    assert cancelled["status"] == "cancelled"
    reader.join(120)
    assert seen[-1]["response"]["status"] == "cancelled" and seen[-1]["response"]["usage"]["output_tokens"] < 400
    assert http.post(f"/v1/responses/{rid}/cancel").status_code == 400  # over: it cannot be cancelled again


@pytest.fixture
def thinking(thinker: Callable[..., Path]) -> Iterator[Served]:
    api.add_model(thinker(R1_TEMPLATE), "r1:tiny")
    api.add_model(thinker(TEMPLATE), "qwen3:tiny")
    with serve(LoadOptions(n_ctx=2048, n_parallel=1), max_loaded=2) as s:
        yield s


def test_a_reasoning_item_round_trips(thinking: Served) -> None:
    """The thought comes back as a reasoning item (content, and a summary when asked), and sent back
    it reaches the template, which renders it before the call it led to (Qwen3's keeps thoughts in
    a tool loop). DeepSeek-R1's template opens the thought in the prompt, so the random model thinks."""
    client = thinking.openai()
    reply = client.responses.create(model="r1:tiny", input="Why is the sky blue?", temperature=1.0,
                                    reasoning={"effort": "high", "summary": "auto"}, max_output_tokens=40,
                                    extra_body={"think_budget": 8, "seed": 3},
                                    include=["reasoning.encrypted_content"])
    (thought,) = [o for o in reply.output if o.type == "reasoning"]
    text = thought.content[0].text
    assert text and thought.summary[0].text == text and thought.encrypted_content
    assert reply.usage.output_tokens_details.reasoning_tokens > 0
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    user = {"role": "user", "content": "Weather in Paris?"}
    bare = client.responses.input_tokens.count(model="qwen3:tiny", tools=[WEATHER], input=[user, call, result])
    with_thought = client.responses.input_tokens.count(
        model="qwen3:tiny", tools=[WEATHER], input=[user, thought.model_dump(exclude_none=True), call, result])
    assert with_thought.input_tokens > bare.input_tokens
    only_sealed = {"type": "reasoning", "id": thought.id, "summary": [], "encrypted_content": thought.encrypted_content}
    sealed = client.responses.input_tokens.count(model="qwen3:tiny", tools=[WEATHER],
                                                 input=[user, only_sealed, call, result])
    assert sealed.input_tokens == with_thought.input_tokens
    # effort "none" turns the template's switch off: Qwen3's then writes an empty thought in the prompt
    off, on = (client.responses.input_tokens.count(model="qwen3:tiny", input="Hi", reasoning={"effort": e})
               for e in ("none", "high"))
    assert off.input_tokens > on.input_tokens


def test_the_agents_sdk_runs_a_tool_with_both_models(served: Served) -> None:
    """An agent with a function tool, on the Responses model and on the chat-completions model: the
    forced call reaches the tool, and its result ends the run."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    client = served.async_openai()
    for model in (OpenAIResponsesModel(MODEL, client), OpenAIChatCompletionsModel(MODEL, client)):
        agent = Agent(name="weather", instructions="Use the tool.", tools=[get_weather], model=model,
                      model_settings=ModelSettings(tool_choice="required", temperature=0),
                      tool_use_behavior="stop_on_first_tool")
        result = Runner.run_sync(agent, "What is the weather in Paris?")
        assert result.final_output == f"Sunny in {calls[-1]}" and calls[-1]
    assert len(calls) == 2


def test_one_of_in_a_tool_schema_is_taken_as_any_of_on_every_api(served: Served) -> None:
    """Qwen Code's tools carry oneOf of objects; "exactly one" cannot be enforced while generating,
    so it is approximated as anyOf (as llguidance's coerce_one_of does), not refused."""
    import jsonschema

    params = {"type": "object", "required": ["target"], "properties": {"target": {"oneOf": [
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}]}}}
    any_of = json.loads(json.dumps(params).replace("oneOf", "anyOf"))
    chat = served.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Open README.md"}], temperature=0,
        tools=[{"type": "function", "function": {"name": "open", "parameters": params}}], tool_choice="required")
    jsonschema.validate(json.loads(chat.choices[0].message.tool_calls[0].function.arguments), any_of)
    resp = served.openai().responses.create(model=MODEL, input="Open README.md", temperature=0,
                                            tools=[{"type": "function", "name": "open", "parameters": params}],
                                            tool_choice="required")
    jsonschema.validate(json.loads(resp.output[0].arguments), any_of)
    ollama = served.ollama().chat(model=MODEL, messages=[{"role": "user", "content": "Open README.md"}],
                                  tools=[{"type": "function", "function": {"name": "open", "parameters": params}}],
                                  options={"temperature": 0})
    assert ollama.message is not None  # accepted (auto: the model may answer instead of calling)
