"""The real Claude Code (`@anthropic-ai/claude-code`, installed by `make agents`) against the real
`localrun serve`, run with `localrun launch claude` as a user runs it (`claude -p`, no network but
localhost): a reply that completes, a tool call it runs, its second request reading the first's
prefix from the cache, and its own prompt past the starter's context, which it reports as too long.
Its prompt is narrowed with its own options (--tools, --system-prompt) to the starter's context."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.agents import agent_or_fail
from tests.conftest import serve_command

MODEL = "smollm2:135m"


def _claude(port: str, home: Path, cwd: Path, *args: str) -> list[dict[str, Any]]:
    """`localrun launch claude MODEL -- -p ...`: Claude Code's stream-json events."""
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LOCALRUN_CLAUDE": str(agent_or_fail("claude")),
           "LOCALRUN_HOME": str(Path(__import__("os").environ["LOCALRUN_HOME"])), "NO_COLOR": "1"}
    out = subprocess.run([sys.executable, "-m", "localrun", "launch", "claude", MODEL, "--port", port, "--",
                          "-p", *args, "--output-format", "stream-json", "--verbose"],
                         cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=500)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert events and events[-1]["type"] == "result", out.stdout[-2000:] + out.stderr[-2000:]
    return events


def test_a_reply_completes_and_the_next_request_reads_the_cache(tmp_path: Path) -> None:
    with serve_command("--ctx", "2048", "--parallel", "1", "--temperature", "0") as (url, _):
        port = url.rsplit(":", 1)[1]
        ask = ("What is the opposite of hot?", "--tools", "", "--system-prompt", "Answer in one short sentence.")
        first = _claude(port, tmp_path / "home", tmp_path, *ask)[-1]
        second = _claude(port, tmp_path / "home", tmp_path, *ask)[-1]
    assert first["subtype"] == "success" and not first["is_error"] and first["stop_reason"] == "end_turn"
    assert "cold" in first["result"].lower()
    u1, u2 = first["usage"], second["usage"]
    total = u1["input_tokens"] + u1["cache_creation_input_tokens"] + u1["cache_read_input_tokens"]
    assert total > 50 and u1["cache_read_input_tokens"] < total
    # the same prompt again: all but its last token is read back (its first line changes nothing)
    assert u2["cache_read_input_tokens"] >= total - 2, (u1, u2)


def test_claude_code_runs_the_tool_the_model_calls(tmp_path: Path) -> None:
    """Write, the one tool it is given: the call's arguments are forced to Write's schema, Claude
    Code writes the file; one turn (--max-turns 1), so its session ends after the tool ran. The
    folder's path is short and fixed: the tiny model copies it from the prompt."""
    work = Path(tempfile.gettempdir()) / "localrun-claude"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        system = (f"You create files with the Write tool. Example: to create {work}/hello.txt containing hello "
                  f'world, call Write with {{"file_path": "{work}/hello.txt", "content": "hello world"}}.')
        with serve_command("--ctx", "1024", "--parallel", "1", "--temperature", "0") as (url, _):
            events = _claude(url.rsplit(":", 1)[1], tmp_path / "home", work, "Create hello.txt containing hello world",
                             "--tools", "Write", "--allowedTools", "Write", "--permission-mode", "acceptEdits",
                             "--system-prompt", system, "--max-turns", "1")
        uses = [b for e in events if e["type"] == "assistant" for b in e["message"]["content"] if b["type"] == "tool_use"]
        results = [b for e in events if e["type"] == "user" for b in e["message"]["content"]
                   if b.get("type") == "tool_result"]
        assert uses and uses[0]["name"] == "Write" and results and not results[0].get("is_error"), events
        written = Path(uses[0]["input"]["file_path"])
        assert written.read_text() == uses[0]["input"]["content"]  # what the model wrote, written
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_its_own_prompt_past_the_context_is_too_long(tmp_path: Path) -> None:
    """Claude Code's default prompt (tens of thousands of tokens with its tools) on 8192: Anthropic's
    400, "prompt is too long: N tokens > M maximum", which Claude Code reports (and compacts on)."""
    with serve_command("--ctx", "8192", "--parallel", "1") as (url, _):
        result = _claude(url.rsplit(":", 1)[1], tmp_path / "home", tmp_path, "hi")[-1]
    assert result["is_error"] and "prompt is too long" in result["result"].lower(), result
