"""Structured output on the starter model: JSON schemas, GBNF grammars and choices on `run` and
`batch`, every output checked with the jsonschema library; bad constraints refused by name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from localrun.constraint import Constraint, check_schema
from localrun.errors import UsageError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
    },
    "required": ["name", "age", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"]}},
    },
    "required": ["status", "items"],
}
EVENT = {
    "$defs": {"level": {"anyOf": [{"enum": ["low", "high"]}, {"type": "integer", "minimum": 1, "maximum": 5}]}},
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 3, "maxLength": 30},
        "date": {"type": "string", "format": "date"},
        "priority": {"$ref": "#/$defs/level"},
        "public": {"type": "boolean"},
    },
    "required": ["title", "date", "priority", "public"],
    "additionalProperties": False,
}
SCHEMAS = [PERSON, ORDER, EVENT]
ASKS = ["Describe a customer as JSON.", "Write an order of a web shop as JSON.", "Describe a meeting as JSON."]


def _rows(n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        k = i % 3
        rows.append({"id": i, "prompt": f"{ASKS[k]} Example {i}.", "schema": SCHEMAS[k], "seed": i,
                     "temperature": 0.9})
    return rows


def test_120_sampled_rows_with_three_schemas_in_one_batch_all_validate(cli: Any, starter: Path, tmp_path: Path) -> None:
    """40 sampled replies per schema, 16 decoding at once (each step masks for three grammars)."""
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _rows(120)))
    out = tmp_path / "out.jsonl"
    res = cli("batch", str(starter), "-i", str(src), "-o", str(out), "--parallel", "16", "--max-tokens", "160")
    assert res.returncode == 0, res.stderr
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == list(range(120))
    for i, rec in records.items():
        assert rec["finish_reason"] == "stop", rec
        jsonschema.validate(json.loads(rec["text"]), SCHEMAS[i % 3])


def test_run_with_grammar_choice_and_format(cli: Any, starter: Path, tmp_path: Path) -> None:
    gbnf = tmp_path / "answer.gbnf"
    gbnf.write_text('root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]\n')
    res = cli("run", str(starter), "What is 7 times 8?", "--grammar", str(gbnf), "--temperature", "0.7", "--seed", "1")
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(r"The answer is [0-9][0-9]?\.\n", res.stdout), res.stdout
    res = cli("run", str(starter), "Is fire hot? Answer yes or no.", "--choice", "yes,no", "--json")
    assert json.loads(res.stdout)["text"] in ("yes", "no")
    res = cli("run", str(starter), "Describe a user of a web site called Ann as JSON.", "--format", "json", "--temperature", "0", "-n", "200", "--json")
    assert isinstance(json.loads(json.loads(res.stdout)["text"]), dict)
    res = cli("run", str(starter), "An order as JSON", "--schema", json.dumps(ORDER), "--json", "--seed", "3")
    jsonschema.validate(json.loads(json.loads(res.stdout)["text"]), ORDER)


def test_bad_constraints_fail_before_generating(cli: Any, starter: Path, tmp_path: Path) -> None:
    res = cli("run", str(starter), "hi", "--schema", '{"type": "array", "uniqueItems": true}')
    assert res.returncode == 2 and "uniqueItems" in res.stderr and not res.stdout
    res = cli("run", str(starter), "hi", "--grammar", "root ::= [0-9")
    assert res.returncode == 2 and "grammar" in res.stderr and not res.stdout
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hi", "schema": {"type": "object", "if": {}}}) + "\n"
                   + json.dumps({"id": "b", "prompt": "Is ice cold?", "choice": ["yes", "no"]}) + "\n")
    out = tmp_path / "out.jsonl"
    res = cli("batch", str(starter), "-i", str(src), "-o", str(out))
    assert res.returncode == 1
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert "'if'" in records["a"]["error"] and "text" not in records["a"]
    assert records["b"]["text"] in ("yes", "no")


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}}, "contentEncoding"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "patternProperties"),
    ({"type": "string", "format": "iri"}, "iri"),
    ({"$ref": "https://example.com/s.json"}, "local references"),
    ({"type": "strng"}, "strng"),
])
def test_unsupported_schema_keywords_are_named(schema: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError, match=re.escape(named)):
        Constraint.schema(schema)


def test_supported_schema_coverage_compiles() -> None:
    for s in SCHEMAS:
        check_schema(s)
        Constraint.schema(s)
    Constraint.schema({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"},
                                                        "v": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
                                                        "k": {"const": "x"}, "n": {"type": "number", "exclusiveMinimum": 0}}})
    assert Constraint.from_spec({"format": "json"}).kind == "json"
    with pytest.raises(UsageError, match="one of"):
        Constraint.from_spec({"schema": {}, "grammar": "root ::= \"a\""})


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]


def test_tools_on_run_and_batch(cli: Any, starter: Path, tmp_path: Path) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(TOOLS))
    res = cli("run", str(starter), "Weather in Oslo?", "--tools", str(tools), "--tool-choice", "required", "--json")
    assert res.returncode == 0, res.stderr
    rec = json.loads(res.stdout)
    assert rec["finish_reason"] == "tool_calls" and rec["tool_calls"][0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(rec["tool_calls"][0]["function"]["arguments"]), WEATHER)
    res = cli("run", str(starter), "Weather in Oslo?", "--tools", str(tools))
    assert res.returncode == 2 and "--json" in res.stderr
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"Weather in {c}?", "seed": i}) + "\n"
                           for i, c in enumerate(["Rome", "Lima", "Kyiv", "Pune"])))
    out = tmp_path / "out.jsonl"
    res = cli("batch", str(starter), "-i", str(src), "-o", str(out), "--tools", str(tools), "--tool-choice", "required")
    assert res.returncode == 0, res.stderr
    for rec in map(json.loads, out.read_text().splitlines()):
        assert rec["finish_reason"] == "tool_calls", rec
        jsonschema.validate(json.loads(rec["tool_calls"][0]["function"]["arguments"]), WEATHER)
