"""`localrun batch` on the starter model: agreement with `run`, ids, resume after a crash, bad rows."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.backends.base import RowResult
from localrun.batch import BatchRow, finished_ids, parse_row
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions

from . import reliability

PROMPTS = [
    "What is the opposite of hot?",
    "Write a haiku about rain.",
    "Name three fruits.",
    "Explain in one sentence why the sky is blue.",
    "Give me a short motto for a bakery.",
    "What is 7 times 8?",
    "Tell me a fun fact about octopuses.",
]
SYSTEM = "You are a concise assistant."


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_reference(requests: list[Request], params: GenerationParams,
                  options: LoadOptions | None = None) -> list[tuple[str, int]]:
    """What `localrun run` gives: the engine, one prompt after another."""
    session = api.load("smollm2:135m", options or LoadOptions())
    out = []
    try:
        for req in requests:
            parts, last = [], None
            for chunk in api.stream(session, req, params):
                if chunk.done:
                    last = chunk
                else:
                    parts.append(chunk.text)
            assert last is not None
            out.append(("".join(parts), last.completion_tokens))
    finally:
        session.close()
    return out


def start_batch(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "localrun", "batch", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_rows(proc: subprocess.Popen[str]) -> str:
    """Block until the CLI reports a finished (already written) row on stderr."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("localrun batch: ") and "/" in line and not line.startswith("localrun batch: 0/"):
            return line
    raise AssertionError(f"the batch ended before any row finished (exit {proc.wait()})")


def test_batch_equals_run_greedy_token_for_token(cli, tmp_path: Path) -> None:
    """Two waves through 3 sequences (slot reuse), a shared system prompt copied between sequences,
    a row with its own system prompt and one with its own max_tokens: all as `run` gives them."""
    rows: list[dict[str, Any]] = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    rows.append({"id": "own-system", "messages": [{"role": "system", "content": "Answer like a pirate."},
                                                  {"role": "user", "content": "Where is the treasure?"}]})
    rows.append({"id": "short", "prompt": "Describe the sea.", "max_tokens": 5})
    out = tmp_path / "out.jsonl"
    res = cli("batch", "smollm2:135m", "--input", str(write_jsonl(tmp_path / "in.jsonl", rows)), "--output", str(out),
              "--parallel", "3", "--temperature", "0", "--max-tokens", "40", "--system", SYSTEM)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr
    got = {r["id"]: r for r in read_jsonl(out)}
    requests = [api.build_messages(p, SYSTEM) for p in PROMPTS]
    requests.append(Request.chat(rows[-2]["messages"]))
    requests.append(api.build_messages("Describe the sea.", SYSTEM))
    ref = run_reference(requests[:-1], GenerationParams(temperature=0, max_tokens=40))
    ref += run_reference(requests[-1:], GenerationParams(temperature=0, max_tokens=5))
    for row, (text, n) in zip(rows, ref, strict=True):
        assert got[row["id"]]["text"] == text, row["id"]
        assert got[row["id"]]["completion_tokens"] == n, row["id"]
    assert got["short"]["finish_reason"] == "length" and got["short"]["completion_tokens"] == 5
    # And the command `run` itself, for one of them.
    one = cli("run", "smollm2:135m", PROMPTS[0], "--temperature", "0", "--max-tokens", "40", "--system", SYSTEM)
    assert one.stdout.rstrip("\n") == got["p0"]["text"].rstrip("\n")


def test_shared_prefix_is_reused_and_order_does_not_matter() -> None:
    """Through the API: ids of both types survive, each row's result does not depend on the other
    rows or their order, and the shared chat header is evaluated once, not per row."""
    params = GenerationParams(temperature=0, max_tokens=12)
    rows = [{"id": i if i % 2 else f"row-{i}", "prompt": p, "max_tokens": 4 + 3 * i} for i, p in enumerate(PROMPTS[:5])]
    session = api.load("smollm2:135m", LoadOptions(n_parallel=4))
    try:
        forward = list(api.batch(session, rows, params, system=SYSTEM))
        backward = list(api.batch(session, rows[::-1], params, system=SYSTEM))
        events = list(session.generate_many([(r["id"], api.build_messages(r["prompt"], SYSTEM), params)
                                             for r in rows]))
    finally:
        session.close()
    assert sorted(map(str, (r["id"] for r in forward))) == sorted(str(r["id"]) for r in rows)
    assert {r["id"] for r in forward} == {r["id"] for r in rows}  # types kept: 1 stays an int
    by_id = {r["id"]: r for r in backward}
    for r in forward:
        assert r == by_id[r["id"]]
        assert r["completion_tokens"] == 4 + 3 * (r["id"] if isinstance(r["id"], int) else int(r["id"][4:]))
    # Written as they finish: backwards, the longest rows come first but do not finish first.
    assert [r["id"] for r in backward] != [r["id"] for r in rows[::-1]]
    rows_done = [e for e in events if isinstance(e, RowResult)]
    assert len(rows_done) == len(rows)
    reused = sum(e.cached_tokens for e in rows_done)
    # The chat header with the system prompt (over 10 tokens) is evaluated once: 3 rows of the
    # first wave copy it, the fifth row finds it in a finished sequence.
    assert reused >= 4 * 10
    assert all(e.cached_tokens < e.prompt_tokens for e in rows_done)


def test_bad_rows_get_errors_and_the_rest_run(cli, tmp_path: Path) -> None:
    rows = [
        {"id": "ok1", "prompt": "What is 2 plus 2?"},
        '{"id": "broken", "prompt": "no closing brace"',
        {"id": "empty"},
        {"id": "both", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "typo", "prompt": "hi", "temprature": 0.5},
        {"id": "badvalue", "prompt": "hi", "top_p": 3},
        {"id": "long", "prompt": "word " * 200},
        {"id": "badmsg", "messages": [{"role": "wizard"}]},
        "[1, 2]",
        {"id": "ok2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3},
    ]
    out = tmp_path / "out.jsonl"
    res = cli("batch", "smollm2:135m", "-i", str(write_jsonl(tmp_path / "in.jsonl", rows)), "-o", str(out),
              "--ctx", "128", "--temperature", "0", "--max-tokens", "8")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    got = {r["id"]: r for r in read_jsonl(out)}
    assert set(got) == {"ok1", "broken", "empty", "both", "typo", "badvalue", "long", "badmsg", 9, "ok2"}
    assert got["ok1"]["text"] and got["ok1"]["completion_tokens"] == 8
    assert got["ok2"]["completion_tokens"] == 3
    expected = {
        "broken": "line 2: invalid JSON",
        "empty": "neither 'prompt' nor 'messages'",
        "both": "both 'prompt' and 'messages'",
        "typo": "unknown setting(s) 'temprature'",
        "badvalue": "invalid value for top_p",
        "long": "context holds 128",
        "badmsg": "line 8:",
        9: "expected a JSON object",
    }
    for rid, needle in expected.items():
        assert set(got[rid]) == {"id", "error"}, got[rid]
        assert needle in got[rid]["error"], got[rid]
    assert "8 failed" in res.stderr.strip().splitlines()[-1]


def test_text_input_and_csv_output(cli, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the opposite of hot?\n\nName a color.\n")
    out = tmp_path / "out.csv"
    res = cli("batch", "smollm2:135m", "--input", str(prompts), "--output", str(out), "--temperature", "0",
              "--max-tokens", "6")
    assert res.returncode == 0, res.stderr
    with out.open(newline="") as f:
        table = list(csv.DictReader(f))
    assert sorted(r["id"] for r in table) == ["1", "3"]  # line numbers; the blank line is skipped
    for r in table:
        assert r["text"] and r["finish_reason"] == "length" and r["completion_tokens"] == "6" and r["error"] == ""
    again = cli("batch", "smollm2:135m", "--input", str(prompts), "--output", str(out), "--resume")
    assert again.returncode == 0 and "2 already done" in again.stderr
    with out.open(newline="") as f:
        assert len(list(csv.DictReader(f))) == 2
    refused = cli("batch", "smollm2:135m", "--input", str(prompts), "--output", str(out))
    assert refused.returncode == 2 and "already exists" in refused.stderr and "--resume" in refused.stderr


def _resume_rows(tmp_path: Path) -> tuple[Path, list[str]]:
    ids = [f"r{i:02d}" for i in range(10)]
    rows = [{"id": rid, "prompt": f"Write a long story about the number {i}."} for i, rid in enumerate(ids)]
    return write_jsonl(tmp_path / "in.jsonl", rows), ids


@pytest.mark.parametrize("how", ["sigkill", "ctrl-c"])
def test_stopped_batch_resumes_each_id_once(cli, tmp_path: Path, how: str) -> None:
    inp, ids = _resume_rows(tmp_path)
    out = tmp_path / "out.jsonl"
    args = ("smollm2:135m", "-i", str(inp), "-o", str(out), "--parallel", "2", "--temperature", "0",
            "--max-tokens", "48")
    proc = start_batch(*args)
    try:
        wait_for_rows(proc)
        proc.send_signal(signal.SIGKILL if how == "sigkill" else signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = read_jsonl(out)
    assert 1 <= len(first) < len(ids), "the batch should have been stopped part way"
    if how == "ctrl-c":
        assert proc.returncode == 130 and "Traceback" not in err
        assert "not run (--resume continues)" in err
    else:
        assert proc.returncode == -signal.SIGKILL
        with out.open("a") as f:
            f.write('{"id": "r09", "text": "half a row cut by the cra')  # as if killed mid-write
    res = cli(*("batch", *args, "--resume"))
    assert res.returncode == 0, res.stderr
    final = read_jsonl(out)
    assert sorted(r["id"] for r in final) == ids
    assert final[: len(first)] == first
    assert all(r["completion_tokens"] > 0 and r["finish_reason"] in ("stop", "length") for r in final)
    if how == "sigkill":
        reliability.fault("SIGKILL", "batch")
    reliability.rows(len(ids), sum(1 for r in first if r not in final))


def test_finished_ids_repairs_a_torn_last_row(tmp_path: Path) -> None:
    jl = tmp_path / "o.jsonl"
    jl.write_text('{"id": 1, "text": "a"}\n{"id": "x", "error": "e"}\n{"id": 3, "te')
    assert finished_ids(str(jl), "jsonl") == {"1", "x"}
    assert jl.read_text().endswith('"e"}\n')
    cs = tmp_path / "o.csv"
    full = ('id,text,thinking,finish_reason,prompt_tokens,completion_tokens,thinking_tokens,error\n'
            '1,"two\nlines",,stop,3,4,,\n')
    cs.write_text(full + '2,"cut in the mid')
    assert finished_ids(str(cs), "csv") == {"1"}
    assert cs.read_text() == full
    assert finished_ids(str(tmp_path / "missing.csv"), "csv") == set()


def test_row_settings_take_the_kind_their_field_declares() -> None:
    def row(**settings: object) -> BatchRow:
        return parse_row({"id": 1, "prompt": "hi", **settings}, 1)

    ok = row(seed=None, max_tokens=None, think_budget=None, logprobs=None, top_k=5, top_p=1)
    assert ok.error is None and ok.params is not None and ok.params.top_k == 5 and ok.params.logprobs is None
    for name, value in (("top_k", 2.5), ("think_budget", 1.5), ("logprobs", 1.5), ("top_p", None), ("seed", True)):
        bad = row(**{name: value})
        assert bad.request is None and f"invalid value for {name}: {value!r}" in (bad.error or ""), (name, bad)


def test_usage_errors(cli, tmp_path: Path) -> None:
    res = cli("batch", "smollm2:135m", "-i", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"))
    assert res.returncode == 2 and "does not exist" in res.stderr and "Traceback" not in res.stderr
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    res = cli("batch", "smollm2:135m", "-i", str(dup), "-o", str(tmp_path / "o.jsonl"))
    assert res.returncode == 2 and "lines 1 and 2" in res.stderr
    assert not (tmp_path / "o.jsonl").exists()
    res = cli("batch", "smollm2:135m", "-i", str(dup), "-o", str(tmp_path / "o.jsonl"), "--parallel", "0")
    assert res.returncode == 2 and "--parallel" in res.stderr
    assert os.listdir(tmp_path) == ["dup.jsonl"]


def test_sequence_length_bounds_every_row_and_falls_back_to_the_model_context() -> None:
    from localrun import batch as batching

    settle = batching.settle({"max_tokens": 64})
    params = settle({}, None)
    rows = [batching.parse_row({"id": 1, "prompt": "short"}, 1, settle),
            batching.parse_row({"id": 2, "prompt": "é" * 300, "max_tokens": 100}, 2, settle)]
    n = batching.sequence_length(rows, params, 4096)
    assert n % 256 == 0 and n >= 600 + batching.TEMPLATE_MARGIN + 100 and n < 4096
    unbounded = [*rows, batching.parse_row({"id": 3, "prompt": "go on"}, 3)]
    assert batching.sequence_length(unbounded, GenerationParams(), 4096) == 4096
    assert batching.sequence_length(rows, params, 512) == 512
