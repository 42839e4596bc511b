"""Property-based fuzzing of batch input rows: any JSON value, any line, becomes a row with a
request or a one-line error; only duplicate ids stop the whole input (a UsageError)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localrun.batch import (
    CONSTRAINT_KEYS,
    BatchRow,
    parse_lines,
    parse_row,
    read_input,
    settle,
)
from localrun.chat import ROLES
from localrun.errors import UsageError
from localrun.settings import GenerationParams, named

from . import reliability

SETTINGS = tuple(named("batch"))  # the keys a row may set

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**32, 2**63, 10**400, -(10**400)]),  # 10**400: an int no float can hold
    st.floats(allow_nan=True, allow_infinity=True),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": st.text(max_size=20)},
                          optional={"tool_calls": json_values, "tool_call_id": json_values, "name": json_values}),
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), json_values, max_size=4),
    json_values,
)
constraint = st.one_of(
    st.just("json"), st.text(max_size=12), json_values,
    st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "array", "bogus"])},
                          optional={"properties": st.dictionaries(st.text(max_size=6), st.just({"type": "string"}),
                                                                  max_size=3)}),
    st.lists(st.text(max_size=6), max_size=4),
)
setting_value = st.one_of(numbers, scalars, st.lists(st.text(max_size=5), max_size=3), json_values)

row = st.fixed_dictionaries({}, optional={
    "id": st.one_of(st.integers(-5, 5), st.text(max_size=6), json_values),
    "prompt": st.one_of(st.text(max_size=30), json_values),
    "messages": st.one_of(st.lists(message, max_size=3), json_values),
    "system": st.one_of(st.text(max_size=10), json_values),
    **{k: setting_value for k in SETTINGS},
    **{k: constraint for k in CONSTRAINT_KEYS},
}).flatmap(lambda d: st.dictionaries(st.text(max_size=10), json_values, max_size=2).map(lambda extra: {**extra, **d}))
any_row = st.one_of(row, row, row, json_values)


def assert_row(r: BatchRow, line: int) -> None:
    """A request and no error, or an error naming the line and no request."""
    assert isinstance(r, BatchRow) and r.line == line
    if r.request is None:
        assert isinstance(r.error, str) and r.error.startswith(f"line {line}: "), r
        assert r.params is None
    else:
        assert r.error is None
        assert isinstance(r.id, (str, int)) and not isinstance(r.id, bool)
        assert r.params is None or isinstance(r.params, GenerationParams)


@FUZZ
@given(data=any_row, line=st.integers(1, 10**6), raw=st.booleans(),
       system=st.one_of(st.none(), st.text(max_size=8)))
def test_any_json_value_is_a_row(data: Any, line: int, raw: bool, system: str | None) -> None:
    """parse_row never raises, whatever the value (known keys with wrong types, extra keys, non-objects)."""
    assert_row(parse_row(data, line, settle(), system, raw), line)
    reliability.inputs("batch row")  # per example: how many rows it holds depends on the draw


def _line(value: Any, cut: int | None) -> str:
    text = json.dumps(value)  # NaN and Infinity as Python writes them, which json.loads reads back
    return text if cut is None else text[: cut % (len(text) + 1)]


lines = st.lists(st.one_of(
    st.tuples(any_row, st.one_of(st.none(), st.integers(0, 200))).map(lambda t: _line(*t)),
    st.text(max_size=30),  # anything at all, JSON or not
    st.sampled_from(['{"id": "\\q", "prompt": ', '{"id": 12, "prompt"', '{"id": "a\\', "   ", "[]", "null",
                     '{"id": "\\ud800", "prompt": "x"', '{"id": -0, "prompt"']),
), max_size=8)


def _check_lines(text_lines: list[str], fmt: str) -> list[BatchRow] | None:
    try:
        rows = parse_lines(text_lines, fmt, settle())
    except UsageError as e:
        assert "appears on lines" in e.message, e.message
        return None
    expected = [n for n, line in enumerate(text_lines, 1) if line.rstrip("\r\n").strip()]
    assert [r.line for r in rows] == expected
    for r in rows:
        assert_row(r, r.line)
    return rows


@FUZZ
@given(text_lines=lines, fmt=st.sampled_from(["jsonl", "text"]))
def test_any_lines_are_rows(text_lines: list[str], fmt: str) -> None:
    """parse_lines: one row per non-blank line, broken JSON included; only a repeated id raises."""
    _check_lines(text_lines, fmt)
    reliability.inputs("batch row")


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(text_lines=lines, suffix=st.sampled_from([".jsonl", ".txt", ".in"]))
def test_any_input_file_is_read(text_lines: list[str], suffix: str) -> None:
    """read_input: rows, or a UsageError (no rows, repeated id); never another exception."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"rows{suffix}"
        p.write_text("\n".join(text_lines), encoding="utf-8")
        try:
            rows = read_input(str(p), settle())
        except UsageError as e:
            assert e.message and ("appears on lines" in e.message or "has no rows" in e.message
                                  or "cannot read" in e.message), e.message
        else:
            for r in rows:
                assert_row(r, r.line)
    reliability.inputs("batch row")


@pytest.mark.parametrize("line", ['{"id": "\\q", "prompt": ', '{"id": 1, "prompt": "x", "temperature": 1' + "0" * 400 + "}"])
def test_found_by_fuzzing(line: str) -> None:
    """Inputs the fuzzing above found: each is a row with an error, not an exception."""
    (r,) = parse_lines([line], "jsonl", settle())
    assert r.request is None and r.error and r.error.startswith("line 1: ")
    reliability.inputs("batch row")
