"""Structured output through the server, as its clients ask for it: openai-python's
response_format (json_object, json_schema) and ollama-python's format ("json" or a schema)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .conftest import MODEL, Served

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,10}$"}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a user of a web site called Ann as JSON."}]


def test_openai_json_schema_validates_streamed_and_not(served: Served) -> None:
    client = served.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        whole = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0.8,
                                               seed=seed, max_tokens=120)
        jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
        assert whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, temperature=0.8,
                                            seed=7, max_tokens=120, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)


def test_openai_json_object_and_pydantic_parse(served: Served) -> None:
    client = served.openai()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                           temperature=0, max_tokens=120)
    assert isinstance(json.loads(whole.choices[0].message.content), dict)

    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: str
        confident: bool

    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Is fire hot?"}],
                                           response_format=Answer, temperature=0, max_tokens=60)
    assert isinstance(parsed.choices[0].message.parsed, Answer)


def test_ollama_format_json_and_schema(served: Served) -> None:
    client = served.ollama()
    res = client.chat(model=MODEL, messages=ASK, format=PERSON, options={"temperature": 0.8, "seed": 3, "num_predict": 120})
    jsonschema.validate(json.loads(res.message.content), PERSON)
    parts = client.chat(model=MODEL, messages=ASK, format=PERSON, stream=True,
                        options={"temperature": 0.8, "seed": 4, "num_predict": 120})
    jsonschema.validate(json.loads("".join(p.message.content for p in parts)), PERSON)
    gen = client.generate(model=MODEL, prompt=ASK[0]["content"], format="json", options={"temperature": 0, "num_predict": 120})
    assert isinstance(json.loads(gen.response), dict)


def test_bad_constraints_are_400_naming_the_problem(served: Served) -> None:
    client = served.openai()
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="strin"):
        client.chat.completions.create(model=MODEL, messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    import ollama

    with pytest.raises(ollama.ResponseError, match="not") as e:
        served.ollama().chat(model=MODEL, messages=ASK, format={"type": "object", "not": {"required": ["a"]}})
    assert e.value.status_code == 400


def test_text_completion_takes_response_format_too(served: Served) -> None:
    with served.http() as http:
        res = http.post("/v1/completions", json={"model": MODEL, "prompt": "Is the sun hot? Answer:", "max_tokens": 40,
                                                 "response_format": {"type": "json_schema", "json_schema": {
                                                     "name": "a", "schema": {"type": "object", "properties": {
                                                         "hot": {"type": "boolean"}}, "required": ["hot"]}}}})
    assert res.status_code == 200
    assert isinstance(json.loads(res.json()["choices"][0]["text"])["hot"], bool)
