"""Constrained replies always end: numbers are bounded as llama.cpp's schema grammars bound them
(16 integer digits; fractions here to 10), also inside values of any type, and a reply whose
token budget runs out inside the constraint is finished along a closing path, so it parses and
still says finish_reason "length"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from localrun.constraint import Constraint, bounded_numbers

from .conftest import ASSETS, assets_or_skip

# The schema of the report: a city with a population, as an extraction library sends it.
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30},
                                         "population": {"type": "integer"}},
        "required": ["name", "country", "population"]}
# What an Ollama client's "name, country, population int" shorthand sends as `format`.
SHORTHAND = {"type": "object", "properties": {"name": {"type": "string"}, "country": {"type": "string"},
                                              "population": {"type": "integer"}},
             "required": ["name", "country", "population"]}
MEASURES = {"type": "object", "properties": {"label": {"type": "string"}, "area": {"type": "number"},
                                             "tags": {"type": "array", "items": {"type": "string"}},
                                             "extra": {"type": "object"}},
            "required": ["label", "area", "tags", "extra"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(assets_or_skip(ASSETS / "tokenizers" / "qwen3" / "tokenizer.json").read_text())


def _accepts(tokenizer: Any, c: Constraint, text: str) -> bool:
    """Whether text is a valid prefix of what the constraint allows."""
    import llguidance

    m = llguidance.LLMatcher(tokenizer, c.grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    ids = tokenizer.tokenize_str(text)
    return m.validate_tokens(ids) == len(ids)


def test_numbers_are_bounded_everywhere(tokenizer: Any) -> None:
    city = Constraint.schema(CITY)
    head = '{"name": "Paris", "country": "France", "population": '
    assert _accepts(tokenizer, city, head + "9" * 16 + "}")
    assert not _accepts(tokenizer, city, head + "9" * 17)
    assert _accepts(tokenizer, city, head + "-" + "9" * 16 + "}")
    anything = Constraint.json_object()  # free values: numbers inside arrays and objects too
    assert _accepts(tokenizer, anything, '{"a": [1, {"b": -2.5}], "c": "x", "d": true, "e": null}')
    for deep in ('{"a": ' + "1" * 17, '{"a": [{"b": ' + "1" * 17, '{"a": 0.' + "1" * 11):
        assert not _accepts(tokenizer, anything, deep)
    measures = Constraint.schema(MEASURES)
    assert _accepts(tokenizer, measures, '{"label": "x", "area": 12.0123456789, "tags": [], "extra": {"k": [1]}}')
    assert not _accepts(tokenizer, measures, '{"label": "x", "area": 1.01234567891')
    assert not _accepts(tokenizer, measures, '{"label": "x", "area": 1, "tags": [], "extra": {"k": ' + "7" * 17)


def test_a_schema_narrows_the_bounds_and_keeps_its_meaning() -> None:
    s = bounded_numbers({"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 3}, "x": {"type": "number", "exclusiveMaximum": 1, "multipleOf": 0.5},
        "s": {"type": "string"}}})
    assert s["properties"]["n"] == {"type": "integer", "minimum": 3, "maximum": 10**16 - 1}
    assert s["properties"]["x"] == {"type": "number", "exclusiveMaximum": 1, "multipleOf": 0.5, "minimum": -(10**16 - 1)}
    assert s["properties"]["s"] == {"type": "string"}
    for doc in ({"n": 3, "x": 0.5, "s": "a"}, {"n": 10**16 - 1, "x": -3}):
        jsonschema.validate(doc, s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"n": 2}, s)


@pytest.mark.parametrize("schema", [CITY, MEASURES, {"type": "array", "minItems": 2,
                                                     "items": {"type": "object"}}], ids=["city", "measures", "array"])
def test_a_closing_path_completes_from_every_prefix(tokenizer: Any, schema: dict[str, Any]) -> None:
    """From every prefix of a long valid reply, the closing path ends in a complete parse."""
    from localrun.backends.grammar import Grammars

    c = Constraint.schema(schema)
    grammars = Grammars(lambda: tokenizer, lambda text: None, tokenizer.vocab_size, lambda t: "")
    doc = {"name": "Paris la grande ville", "country": "France", "population": 2165423, "label": "room 12",
           "area": -1234.5, "tags": ["big", "old"], "extra": {"floors": [1, 2], "lift": True}}
    if schema["type"] == "array":
        doc = [{"a": [1.25, "x"]}, {}]
    else:
        doc = {k: doc[k] for k in schema["properties"]}
    ids = tokenizer.tokenize_str(json.dumps(doc))
    m = grammars.matcher(c.grammar)
    for n in range(len(ids) + 1):
        path = grammars.closing(m, 200)
        assert path is not None, tokenizer.decode_str(ids[:n])
        text = tokenizer.decode_str(ids[:n] + path)
        jsonschema.validate(json.loads(text), schema)
        if n < len(ids):
            assert m.consume_token(ids[n])


@pytest.mark.parametrize("lark", [Constraint.choice(["yes", "plain", "Reykjavik"]).grammar,
                                  'start: /[0-9]{3}-[A-Z]{2}/',
                                  Constraint.schema({"enum": ["north", "south"]}).grammar],
                         ids=["choice", "pattern", "enum"])
def test_a_closing_path_completes_a_grammar_that_starts_with_no_json_closer(tokenizer: Any, lark: str) -> None:
    """A choice or pattern whose first character is none of the JSON closers (a quote, a bracket,
    a digit...) is closed with any printable character it allows: the closing path ended at None
    there, and a reply cut by its budget ended unparsed."""
    import llguidance

    from localrun.backends.grammar import Grammars

    grammars = Grammars(lambda: tokenizer, lambda text: None, tokenizer.vocab_size, lambda t: "")
    m = grammars.matcher(lark)
    path = grammars.closing(m, 50)
    assert path is not None
    check = llguidance.LLMatcher(tokenizer, lark, log_level=0)
    assert check.consume_tokens(path) and check.is_accepting(), tokenizer.decode_str(path)


def _batch(cli: Any, starter: Path, tmp_path: Path, rows: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    res = cli("batch", str(starter), "-i", str(src), "-o", str(out), "--parallel", "16")
    assert res.returncode == 0, res.stderr
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_every_reply_ends_within_its_budget_and_parses(cli: Any, starter: Path, tmp_path: Path) -> None:
    """The starter at several temperatures, seeds and budgets: budgets from one too small for any
    object of the schema to 'none' (the context's)."""
    rows = []
    for i, (temperature, budget) in enumerate((t, b) for t in (0.0, 0.7, 1.0, 1.3) for b in (24, 28, 40, 64, None)):
        for seed in (1, 2):
            rows.append({"id": f"{i}-{seed}", "prompt": "Describe Paris.", "schema": CITY,
                         "temperature": temperature, "seed": seed, **({"max_tokens": budget} if budget else {})})
    rows.append({"id": "ollama", "prompt": "Paris", "schema": SHORTHAND, "temperature": 0, "max_tokens": 600})
    rows.append({"id": "measures", "prompt": "Measure a room.", "schema": MEASURES, "temperature": 1.0,
                 "seed": 3, "max_tokens": 48})
    records = _batch(cli, starter, tmp_path, rows)
    assert sorted(records) == sorted(r["id"] for r in rows)
    cut = 0
    for row in rows:
        rec = records[row["id"]]
        budget = row.get("max_tokens")
        assert "error" not in rec, rec
        if budget is not None:
            assert rec["completion_tokens"] <= budget, rec
        assert rec["finish_reason"] == ("length" if rec["completion_tokens"] == budget else "stop"), rec
        cut += rec["finish_reason"] == "length"
        jsonschema.validate(json.loads(rec["text"]), row["schema"])
    assert cut >= 4  # the small budgets did cut replies, and each cut reply parsed
