"""Anthropic's Messages API through the official anthropic SDK: replies whole and streamed (each
event checked against the SDK's types), tools with forced and automatic choice, thinking with a
budget, stop reasons, usage counted as Anthropic counts it (the three counts add up to
count_tokens), the prompt cache across Claude Code's changing first line and across concurrent
sub-agents, model tiers by alias, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from pydantic import TypeAdapter

from localrun import api
from localrun.settings import LoadOptions
from tests.thinking_models import R1_TEMPLATE, TEMPLATE

from .conftest import MODEL, Served, serve, sse

ASK = [{"role": "user", "content": "What is the opposite of hot?"}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with serve(LoadOptions(n_ctx=2048, n_parallel=3), aliases=(("claude-haiku-*", MODEL),)) as s:
        yield s


def client(served: Served, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=300, **kw)


def _stream(served: Served, body: dict[str, Any]) -> list[Any]:
    """A streamed message's events, each parsed by the SDK's own event types."""
    from anthropic.types import RawMessageStreamEvent

    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    return [adapter.validate_python(data) for data in sse(served, "/v1/messages?beta=true", body,
                                                          {"anthropic-version": "2023-06-01"})
            if data["type"] != "ping"]


def _total(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_reply_whole_and_streamed(served: Served) -> None:
    c = client(served)
    whole = c.messages.create(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY)
    assert whole.stop_reason == "max_tokens" and "cold" in whole.content[0].text
    assert whole.usage.output_tokens == 30
    counted = c.messages.count_tokens(model=MODEL, messages=ASK)
    assert _total(whole.usage) == counted.input_tokens  # the three counts are the whole prompt
    events = _stream(served, {"model": MODEL, "max_tokens": 30, "messages": ASK, **GREEDY})
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.content[0].text
    start, end = events[0].message.usage, events[-2].usage
    assert _total(start) == _total(end) == counted.input_tokens and end.output_tokens == 30
    assert events[-2].delta.stop_reason == "max_tokens"
    with c.messages.stream(model=MODEL, max_tokens=30, messages=ASK, extra_body=GREEDY) as stream:
        assert stream.get_final_text() == whole.content[0].text


def test_stop_sequences_and_end_turn(served: Served) -> None:
    c = client(served)
    cut = c.messages.create(model=MODEL, max_tokens=30, messages=ASK, stop_sequences=["cold"], extra_body=GREEDY)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", "cold")
    assert not cut.content[0].text.endswith("cold")
    short = c.messages.create(model=MODEL, max_tokens=200, system="Answer in three words.",
                              messages=[{"role": "user", "content": "Say hi."}], extra_body=GREEDY)
    assert short.stop_reason == "end_turn" and short.usage.output_tokens < 200


def test_tools_forced_and_automatic_round_trip(served: Served) -> None:
    c = client(served)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = c.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=ask, extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert forced.stop_reason == "tool_use"
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str)
    history = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in forced.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    again = c.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER], messages=history, extra_body=GREEDY,
                              tool_choice={"type": "tool", "name": "get_weather"})
    # the first turn and its call are in the KV cache: only the result and what follows are new
    assert again.usage.cache_read_input_tokens > _total(forced.usage)
    answer = c.messages.create(model=MODEL, max_tokens=30, tools=[WEATHER], messages=history,
                               tool_choice={"type": "none"}, extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    events = _stream(served, {"model": MODEL, "max_tokens": 100, "tools": [WEATHER], "messages": ask, **GREEDY,
                              "tool_choice": {"type": "any"}})
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert events[1].content_block.type == "tool_use" and json.loads("".join(pieces))["city"]
    assert events[-2].delta.stop_reason == "tool_use"
    auto = c.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], messages=ask, extra_body=GREEDY)
    assert auto.stop_reason in ("tool_use", "end_turn", "max_tokens")


def test_the_first_line_claude_code_changes_every_time_does_not_defeat_the_cache(served: Served) -> None:
    """Claude Code's system prompt starts with `x-anthropic-billing-header: ...; cch=<nonce>`; the
    line is left out, so the second request reads the whole shared prefix from the cache."""
    c = client(served)
    rules = "You are a careful assistant. " * 40

    def ask(nonce: str, question: str) -> Any:
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197; cch={nonce};"},
                  {"type": "text", "text": rules, "cache_control": {"type": "ephemeral"}}]
        return c.messages.create(model=MODEL, max_tokens=4, system=system, extra_body=GREEDY,
                                 messages=[{"role": "user", "content": question}])

    first, second = ask("a1b2c", "Name a fruit."), ask("f9e8d", "Name a color.")
    assert first.usage.cache_creation_input_tokens > 240 and first.usage.input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 240  # the rules, read back
    assert second.usage.cache_creation_input_tokens < 20  # only the new question


def test_sub_agents_that_share_a_prompt_evaluate_it_once(served: Served) -> None:
    """Three requests at once with the same system prompt (sub-agents): its tokens are evaluated
    for one of them and shared with the others' sequences."""
    c = client(served)
    system = "You review code for bugs. " * 60
    c.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}], extra_body=GREEDY)
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        results[i] = c.messages.create(model=MODEL, max_tokens=4, system=system, extra_body=GREEDY,
                                       messages=[{"role": "user", "content": f"Review file {i}.py"}])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    prefix = c.messages.count_tokens(model=MODEL, system=system, messages=[{"role": "user", "content": "x"}]).input_tokens
    evaluated = sum(r.usage.cache_creation_input_tokens + r.usage.input_tokens for r in results.values())
    assert evaluated < prefix * 1.5, [r.usage for r in results.values()]


def test_thinking_with_a_budget_and_signatures_that_round_trip(thinker: Callable[..., Path]) -> None:
    api.add_model(thinker(R1_TEMPLATE), "r1:tiny")
    api.add_model(thinker(TEMPLATE), "qwen3:tiny")
    with serve(LoadOptions(n_ctx=2048, n_parallel=1), max_loaded=2) as s:
        c = client(s)
        ask = [{"role": "user", "content": "Why is the sky blue?"}]
        short, long = (c.messages.create(model="r1:tiny", max_tokens=40, messages=ask,
                                         thinking={"type": "enabled", "budget_tokens": b},
                                         extra_body={"temperature": 1.0, "seed": 3}) for b in (2, 12))
        (thought,) = [b for b in short.content if b.type == "thinking"]
        assert thought.thinking and thought.signature
        assert len(thought.thinking) < len(next(b for b in long.content if b.type == "thinking").thinking)
        events = _stream(s, {"model": "r1:tiny", "max_tokens": 40, "messages": ask, "temperature": 1.0, "seed": 3,
                             "thinking": {"type": "enabled", "budget_tokens": 2}})
        kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert kinds[0] == "thinking_delta" and "signature_delta" in kinds and "text_delta" in kinds
        # sent back, the thought reaches a template that renders it (Qwen3's, before the call it led to)
        call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
        result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}

        def count(*blocks: dict[str, Any]) -> int:
            return c.messages.count_tokens(model="qwen3:tiny", tools=[WEATHER], messages=[
                ask[0], {"role": "assistant", "content": [*blocks, call]}, result]).input_tokens

        plain, with_thought = count(), count(thought.model_dump())
        assert with_thought > plain
        assert count({"type": "redacted_thinking", "data": thought.signature}) == with_thought
        off = c.messages.count_tokens(model="qwen3:tiny", messages=ask, thinking={"type": "disabled"})
        assert off.input_tokens > c.messages.count_tokens(model="qwen3:tiny", messages=ask).input_tokens


def test_models_tiers_and_names_that_are_not_installed(served: Served) -> None:
    c = client(served)
    listed = c.models.list()
    assert MODEL in [m.id for m in listed.data] and listed.data[0].type == "model"
    tier = c.messages.create(model="claude-haiku-4-5-20251001", max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert tier.model == MODEL  # `serve --alias claude-haiku-*=smollm2:135m`
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=3, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert MODEL in e.value.body["error"]["message"]  # the installed models, named


def test_errors_come_in_anthropics_shape_never_a_500(served: Served) -> None:
    http = served.http()
    for body, where in (({"model": MODEL, "messages": ASK}, "max_tokens"),
                        ({"model": MODEL, "max_tokens": 5, "messages": "hi"}, "messages"),
                        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "x"}]}]},
                         "type"),
                        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "hi"}]}, "role"),
                        ({"model": MODEL, "max_tokens": 5, "messages": ASK, "thinking": {"type": "enabled",
                                                                                      "budget_tokens": -1}},
                         "budget_tokens")):
        res = http.post("/v1/messages", json=body)
        assert res.status_code == 400, (body, res.text)
        assert res.json()["type"] == "error" and res.json()["error"]["type"] == "invalid_request_error"
        assert where in res.json()["error"]["message"], res.text
    res = http.post("/v1/messages", content=b"{not json")
    assert res.status_code == 400 and res.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client(served).messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "word " * 3000}])
    assert e.value.body["error"]["message"].startswith("prompt is too long: ")
    assert " tokens > 2048 maximum" in e.value.body["error"]["message"]


def test_x_api_key_is_taken_as_the_key() -> None:
    with serve(LoadOptions(n_ctx=512, n_parallel=1), api_key="sekrit") as s:
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=s.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=ASK)
        assert e.value.body["error"]["type"] == "authentication_error"
        ok = anthropic.Anthropic(base_url=s.url, api_key="sekrit", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=ASK)
        assert ok.usage.output_tokens == 2
