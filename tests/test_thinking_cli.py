"""Thinking through the command line: `run` puts the thought on stderr (or hides it, or in --json
beside the text), `batch` writes it in each row; on a tiny random Qwen3 with the real Qwen3
tokenizer and the DeepSeek-R1 and Qwen3 templates (tests/thinking_models.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from localrun import api
from tests.thinking_models import R1_TEMPLATE

# DeepSeek-R1's template opens the thought in the prompt: the random model thinks until the budget
# inserts </think>, then answers (sampled: greedy, the random model repeats whitespace).
SAMPLED = ["--temperature", "1", "--seed", "3", "-n", "30"]


@pytest.fixture
def models(thinker: Callable[..., Path]) -> None:
    api.add_model(thinker(R1_TEMPLATE), "r1:tiny")
    api.add_model(thinker(), "qwen3:tiny")


def test_run_json_has_the_thought_beside_the_text(cli, models: None) -> None:  # noqa: ANN001
    r = cli("run", "r1:tiny", "Why is the sky blue?", "--json", "--think-budget", "6", *SAMPLED)
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["thinking"] and record["text"] and record["thinking_tokens"] == 6
    assert "</think>" not in record["text"]
    # Printed: the answer alone on stdout, the thought on stderr (not a terminal here: no escapes).
    shown = cli("run", "r1:tiny", "Why is the sky blue?", "--think-budget", "6", *SAMPLED)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == record["text"].strip()
    assert record["thinking"] in shown.stderr and "\x1b[" not in shown.stderr
    hidden = cli("run", "r1:tiny", "Why is the sky blue?", "--think-budget", "6", "--hide-thinking", *SAMPLED)
    assert hidden.stdout == shown.stdout and record["thinking"] not in hidden.stderr


def test_run_no_think_switches_the_template_off(cli, models: None) -> None:  # noqa: ANN001
    def prompt_tokens(*flags: str) -> int:
        r = cli("run", "qwen3:tiny", "hi", "--json", "-n", "1", *flags)
        assert r.returncode == 0, r.stderr
        return int(json.loads(r.stdout)["prompt_tokens"])

    # Qwen3's template writes an empty, closed thought into the prompt when thinking is off.
    assert prompt_tokens("--no-think") == prompt_tokens("--think") + 4
    bad = cli("run", "qwen3:tiny", "hi", "--no-think", "--think-effort", "low")
    assert bad.returncode != 0 and "--think-effort and --no-think cannot be combined" in bad.stderr


def test_batch_rows_carry_their_thought_and_own_budget(cli, models: None, tmp_path: Path) -> None:  # noqa: ANN001
    rows = [{"id": "a", "prompt": "Why is the sky blue?", "think_budget": 3},
            {"id": "b", "prompt": "Why is the sky blue?", "think_budget": 9},
            {"id": "c", "prompt": "Why is the sky blue?", "think": False, "think_budget": 2}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = cli("batch", "r1:tiny", "-i", str(src), "-o", str(out), *SAMPLED)
    assert r.returncode == 0, r.stderr
    got = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert got["a"]["thinking_tokens"] == 3 and got["b"]["thinking_tokens"] == 9
    assert got["a"]["thinking"] and got["b"]["thinking"] and got["a"]["text"] and got["b"]["text"]
    assert "</think>" not in got["a"]["text"] + got["b"]["text"]
    # R1's template cannot switch thinking off: the row still thinks, apart, within its own budget.
    assert got["c"]["thinking_tokens"] == 2
