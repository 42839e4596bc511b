"""Thinking's edges through the command line: thinking asked of a model that cannot think is
refused (run, batch, a batch row), thinking off on a template that always thinks (gpt-oss) is said
once, raw prompts are split only when the prompt or the reply opens a thought, and batch's CSV has
the thought in its own column. On the starter (cannot think) and tiny random Qwen3s with the real
Qwen3 tokenizer and the DeepSeek-R1 and gpt-oss templates (tests/thinking_models.py)."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from localrun import api
from localrun.reasoning import Split, detect
from localrun.reasoning.base import RawSplitter
from tests.test_reasoning import templates
from tests.thinking_models import HARMONY_TOKENS, R1_TEMPLATE

SAMPLED = ["--temperature", "1", "--seed", "3"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama.cpp's gpt-oss template as a file, for the session's thinker."""
    path = tmp_path_factory.mktemp("edges") / "openai-gpt-oss-120b.jinja"
    path.write_text(templates()["openai-gpt-oss-120b"])
    return path


@pytest.fixture
def models(thinker: Callable[..., Path], gpt_oss: Path) -> None:
    api.add_model(thinker(R1_TEMPLATE), "r1:tiny")
    api.add_model(thinker(gpt_oss, HARMONY_TOKENS), "oss:tiny")


def _rows(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_think_on_a_model_that_cannot_think_is_refused(cli, tmp_path: Path) -> None:  # noqa: ANN001
    for flag in ("--think", "--think-effort=high"):
        r = cli("run", "smollm2:135m", "hi", flag)
        assert r.returncode == 2 and "model 'smollm2:135m' does not support thinking" in r.stderr, r.stderr
        assert "use a model that thinks" in r.stderr and r.stdout == ""
    rows = _rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi", "think": True},
                                         {"id": "b", "prompt": "hi", "think": False}, {"id": "c", "prompt": "hi"}])
    out = tmp_path / "out.jsonl"
    r = cli("batch", "smollm2:135m", "-i", str(rows), "-o", str(out), "--think")
    assert r.returncode == 2 and "model 'smollm2:135m' does not support thinking" in r.stderr
    assert not out.exists()
    r = cli("batch", "smollm2:135m", "-i", str(rows), "-o", str(out), "-n", "2")
    assert r.returncode == 1, r.stderr  # one row failed, the others ran
    got = {rec["id"]: rec for rec in map(json.loads, out.read_text().splitlines())}
    assert got["a"] == {"id": "a", "error": "line 1: model 'smollm2:135m' does not support thinking; "
                                           "drop 'think' from the row, or use a model that thinks"}
    assert "text" in got["b"] and "text" in got["c"]


def test_no_think_on_gpt_oss_keeps_the_thought_apart_and_says_so_once(cli, models: None) -> None:  # noqa: ANN001
    r = cli("run", "oss:tiny", "hi", "--no-think", "--json", "-n", "4", *SAMPLED)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("oss:tiny always thinks") == 1 and "cannot switch thinking off" in r.stderr
    json.loads(r.stdout)
    quiet = cli("run", "oss:tiny", "hi", "--think-effort", "low", "--json", "-n", "4", *SAMPLED)
    assert quiet.returncode == 0 and "always thinks" not in quiet.stderr, quiet.stderr
    assert "thinking" in api.capabilities(api.resolve_target("oss:tiny").model)


def test_a_raw_prompt_is_split_only_where_a_thought_opens(cli, models: None) -> None:  # noqa: ANN001
    # A reply that does not open a thought is text, untouched (chat replies are trimmed); whether
    # a reply that opens one is split is test_raw_splitter_streams_any_cut_alike's case.
    r = cli("run", "r1:tiny", "Q: why?\nA:", "--raw", "--json", "--grammar", 'root ::= "  so x"')
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["text"] == "  so x" and "thinking" not in rec
    # The raw prompt opens the thought: the reply is thought until the budget closes it.
    r = cli("run", "r1:tiny", "Q: why?\nA: <think>\n", "--raw", "--json", "--think-budget", "5", "-n", "20", *SAMPLED)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["thinking_tokens"] == 5 and rec["thinking"] and "</think>" not in rec["text"]


def test_raw_splitter_streams_any_cut_alike() -> None:
    fmt = detect(R1_TEMPLATE.read_text())
    assert fmt is not None
    for raw, want in [("  <think> a </think>\n\nb", Split("a", "b")), ("  x <think>a</think>", Split(answer="  x <think>a</think>")),
                      ("<thi", Split(answer="<thi")), ("\n\n", Split(answer="\n\n"))]:
        for size in (1, 2, 3, len(raw)):
            s = RawSplitter(fmt.opening, fmt.splitter())
            got = Split()
            for i in range(0, len(raw), size):
                got += s.feed(raw[i:i + size])
            assert got + s.flush() == want, (raw, size)


def test_batch_csv_has_the_thought_in_its_own_column(cli, models: None, tmp_path: Path) -> None:  # noqa: ANN001
    rows = _rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Why is the sky blue?", "think_budget": 3},
                                         {"id": "b", "prompt": "Why?", "think_budget": 0}])
    out = tmp_path / "out.csv"
    r = cli("batch", "r1:tiny", "-i", str(rows), "-o", str(out), "-n", "12", *SAMPLED)
    assert r.returncode == 0, r.stderr
    with out.open(newline="") as f:
        table = {row["id"]: row for row in csv.DictReader(f)}
    assert list(next(iter(table.values()))) == ["id", "text", "thinking", "finish_reason", "prompt_tokens",
                                                 "completion_tokens", "thinking_tokens", "error"]
    assert table["a"]["thinking"] and table["a"]["thinking_tokens"] == "3" and "</think>" not in table["a"]["text"]
    assert table["b"]["thinking"] == "" and table["b"]["text"]
    # an older file with other columns is not resumed into (its rows would be cut as torn)
    old = tmp_path / "old.csv"
    old.write_text("id,text,finish_reason,prompt_tokens,completion_tokens,error\n1,hi,stop,3,4,\n")
    r = cli("batch", "r1:tiny", "-i", str(rows), "-o", str(old), "--resume")
    assert r.returncode == 2 and "write to a new file, or drop --resume" in r.stderr
    assert old.read_text().endswith("1,hi,stop,3,4,\n")


def test_a_schema_on_gpt_oss_holds_the_final_message_after_the_analysis(models: None) -> None:
    """gpt-oss's answer header is several special tokens (<|start|>assistant<|channel|>final<|message|>
    after its analysis): the grammar lets the analysis come first, then takes that header as those
    tokens, then holds the answer to the schema. Sampled on 24 seeds, the random model writes the
    analysis on some and goes straight to its answer on others; every answer parses, no markup
    leaks, and every thought ends at its budget of 4 tokens with the format's own header."""
    from localrun.backends.llama_cpp import LlamaCppEngine
    from localrun.backends.loop import InProcess
    from localrun.constraint import Constraint
    from localrun.generation import Request
    from localrun.settings import GenerationParams, LoadOptions

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    ip = InProcess(LlamaCppEngine(api.get_model("oss:tiny"), LoadOptions(n_ctx=512)))
    try:
        fmt = ip.engine.reasoning
        assert fmt is not None and fmt.name == "harmony"
        assert fmt.closing_text == "<|end|><|start|>assistant<|channel|>final<|message|>"
        thoughts = []
        for seed in range(1, 25):
            request = Request.chat([{"role": "user", "content": "A city as JSON"}])
            params = GenerationParams(temperature=1.0, seed=seed, max_tokens=48, think_budget=4,
                                      grammar=Constraint.schema(schema).grammar)
            chunks = list(ip.stream(request, params))
            thinking, answer = "".join(c.thinking for c in chunks), "".join(c.text for c in chunks)
            assert chunks[-1].finish_reason == "stop" and isinstance(json.loads(answer)["city"], str), (seed, answer)
            assert "<|" not in thinking + answer
            assert chunks[-1].thinking_tokens == (4 if thinking else 0)
            thoughts.append(bool(thinking))
    finally:
        ip.close()
    assert any(thoughts) and not all(thoughts), thoughts


def test_a_schema_after_granite_s_thought_expects_its_response_wrapper() -> None:
    """Granite writes <response> between its thought and its answer: the grammar after the thought
    takes it there (and an answer with no thought at all), never a bare answer after </think>."""
    import llguidance

    from localrun.constraint import Constraint
    from localrun.tools.lark import after_thought, resolve_specials

    from .conftest import ASSETS

    fmt = detect(templates()["ibm-granite-granite-3.3-2B-Instruct"])
    assert fmt is not None and fmt.answer_head == "<response>"
    tok = llguidance.LLTokenizer((ASSETS / "tokenizers" / "qwen3" / "tokenizer.json").read_text())
    lark = after_thought(Constraint.schema({"type": "object"}).grammar, "<think>", "</think>", False, fmt.answer_head)

    def special_id(text: str) -> int | None:
        ids = tok.tokenize_str(text)
        return ids[0] if len(ids) == 1 and tok.is_special_token(ids[0]) else None

    def full(text: str) -> bool:
        m = llguidance.LLMatcher(tok, resolve_specials(lark, special_id), log_level=0)
        ids = tok.tokenize_str(text)
        return m.validate_tokens(ids) == len(ids) and bool(m.consume_tokens(ids)) and m.is_accepting()

    assert full('<think>hm, a city</think><response>{"a": 1}') and full('<response>{}') and full('{"a": 1}')
    assert not full('<think>hm</think>{"a": 1}')
