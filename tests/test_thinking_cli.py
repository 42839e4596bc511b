"""Thinking through the command line: `run` puts the thought on stderr (or hides it, or in --json
beside the text), the interactive chat gives it back to later turns, `batch` writes it in each row;
on a tiny random Qwen3 with the real Qwen3 tokenizer and the DeepSeek-R1 and Qwen3 templates
(tests/thinking_models.py), and Bielik's from llama.cpp's collection."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.chat import parse_messages, render_template
from localrun.reasoning import detect
from tests.test_cli import Terminal
from tests.test_reasoning import templates
from tests.thinking_models import R1_TEMPLATE, TOKENIZER

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


# Bielik's template writes every earlier turn's thought back into the prompt (from reasoning_content),
# and with thinking on its prompt opens the thought; R1's drops earlier thoughts.
BIELIK = "Bielik-11B-v3.0-Instruct"
# On a terminal: the thought dimmed on stderr, a line break, the answer on stdout, the statistics.
TURN = re.compile(r"((?:\x1b\[2m.*?\x1b\[0m)+)\r\n(.*?)\r\n\[(\d+) prompt tokens in \d+ ms, ", re.S)
DIMMED = re.compile(r"\x1b\[2m(.*?)\x1b\[0m", re.S)


@pytest.fixture(scope="module")
def bielik(thinker: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    template = tmp_path_factory.mktemp("templates") / f"{BIELIK}.jinja"
    template.write_text(templates()[BIELIK], encoding="utf-8")
    return thinker(template)


def _chat_turn(term: Terminal, text: str) -> tuple[str, str, int]:
    """Ask one question in the interactive chat: (the thought, the answer, the prompt's tokens)."""
    start = len(term.out)
    term.send(text + "\r")
    term.expect(">>> ", start=start + len(text))
    printed = term.out[start:].decode(errors="replace").split(text, 1)[1]
    turn = TURN.search(printed)
    assert turn is not None, printed
    thought = "".join(DIMMED.findall(turn[1]))
    # The terminal writes each line break as \r\n.
    return thought.replace("\r\n", "\n"), turn[2].replace("\r\n", "\n"), int(turn[3])


@pytest.mark.parametrize("name", ["bielik", "r1"])
def test_interactive_chat_gives_the_thought_back_as_the_template_reads_it(name: str, bielik: Path,
                                                                         thinker: Callable[..., Path]) -> None:
    from tokenizers import Tokenizer

    model = bielik if name == "bielik" else thinker(R1_TEMPLATE)
    source = templates()[BIELIK] if name == "bielik" else R1_TEMPLATE.read_text(encoding="utf-8")
    api.add_model(model, "chat:tiny")
    term = Terminal("run", "chat:tiny", "--think", "--think-budget", "6", *SAMPLED, "--verbose")
    term.expect(">>> ")
    first, second = "Why is the sky blue?", "And the sea?"
    thought, answer, p1 = _chat_turn(term, first)
    assert thought.strip() and answer.strip()
    _, _, p2 = _chat_turn(term, second)
    term.send("\x04")
    assert term.wait() == 0

    fmt = detect(source)
    assert fmt is not None
    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))

    def tokens(*later: dict[str, Any]) -> int:
        conversation = parse_messages([{"role": "user", "content": first}, *later])
        text = render_template(source, conversation, history_field=fmt.history_field, **fmt.switch(True).variables)
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    # The second prompt is the first one grown by the first reply, its thought as the template
    # writes it (Bielik's keeps it, R1's drops it), and the second question (the BOS the engine
    # renders is in both prompts, so the difference leaves it out).
    reply = {"role": "assistant", "content": answer}
    kept = tokens({**reply, "thinking": thought}, {"role": "user", "content": second}) - tokens()
    dropped = tokens(reply, {"role": "user", "content": second}) - tokens()
    assert p2 - p1 == kept
    assert (kept > dropped) == (name == "bielik")
