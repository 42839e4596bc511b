"""The real `localrun` command line: results on stdout, one-line errors on stderr, exit codes."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from .conftest import REPO


def _one_line_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_run_prints_only_the_reply(cli) -> None:
    res = cli("run", "smollm2:135m", "What is the opposite of hot?", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert "cold" in res.stdout.lower()
    assert res.stderr == ""


def test_run_json(cli) -> None:
    res = cli("run", "smollm2", "The capital of France is", "--raw", "--json", "--temperature", "0", "--max-tokens", "3")
    assert res.returncode == 0, res.stderr
    obj = json.loads(res.stdout)
    assert obj["text"].startswith(" Paris")
    assert obj["completion_tokens"] == 3 and obj["finish_reason"] == "length"
    assert obj["prompt_tokens"] == 5 and obj["tokens_per_second"] > 0


def test_run_reads_stdin(cli) -> None:
    res = cli("run", "smollm2:135m", "-", "--temperature", "0", "--max-tokens", "20", input="What is the opposite of hot?")
    assert res.returncode == 0 and "cold" in res.stdout.lower()
    piped = cli("run", "smollm2:135m", "--temperature", "0", "--max-tokens", "20", input="What is the opposite of hot?")
    assert piped.stdout == res.stdout


def test_run_stop_and_system(cli) -> None:
    res = cli("run", "smollm2:135m", "Count from 1 to 10, separated by commas.", "--temperature", "0",
              "--stop", "5", "--system", "You are a counting assistant.")
    assert res.returncode == 0
    assert "4" in res.stdout and "5" not in res.stdout


def test_unknown_model(cli) -> None:
    _one_line_error(cli("run", "smolm2:135m", "hi"), 1, "not installed", "smollm2:135m")


def test_invalid_flags(cli) -> None:
    _one_line_error(cli("run", "smollm2", "hi", "--temperature", "hot"), 2, "--temperature", "--help")
    _one_line_error(cli("run", "smollm2", "hi", "--top-p", "3"), 2, "--top-p", "expected")
    _one_line_error(cli("run", "smollm2", "hi", "--ctx", "-5"), 2, "--ctx")
    _one_line_error(cli("run", "smollm2", "hi", "--gpu-layers", "many"), 2, "--gpu-layers")
    _one_line_error(cli("run", "smollm2", "hi", "--max-tokens", "0"), 2, "--max-tokens")
    _one_line_error(cli("run", "smollm2", "   "), 2, "prompt is empty")


def test_bad_files(cli, stories: Path, tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    _one_line_error(cli("run", str(missing), "hi"), 1, "does not exist")
    text = tmp_path / "readme.gguf"
    text.write_text("not a model")
    _one_line_error(cli("run", str(text), "hi"), 1, "not a GGUF file")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(stories.read_bytes()[:600_000])
    _one_line_error(cli("run", str(cut), "hi"), 1, "truncated")
    _one_line_error(cli("add", str(cut)), 1, "truncated")


def test_prompt_longer_than_context(cli, stories: Path) -> None:
    _one_line_error(cli("run", str(stories), "Once upon a time " * 100, "--raw", "--ctx", "64"), 1,
                    "context holds 64", "--ctx")


def test_store_commands(cli, stories: Path) -> None:
    res = cli("add", str(stories), "--name", "stories:260k", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["name"] == "stories:260k"
    listed = json.loads(cli("list", "--json").stdout)
    by_name = {m["name"]: m for m in listed}
    assert by_name["stories:260k"]["parameters"] == 292800
    assert by_name["smollm2:135m"]["quantization"] == "Q4_1"
    table = cli("list").stdout
    assert "stories:260k" in table and "NAME" in table and "98.4 MB" in table
    shown = json.loads(cli("show", "stories:260k", "--json").stdout)
    assert shown["path"] == os.path.abspath(stories) and shown["tokenizer"] == "llama" and shown["vocab_size"] == 512
    text = cli("show", "smollm2:135m").stdout
    assert "apache-2.0" in text and "<|im_start|>" in text and "smollm" in text
    res = cli("rm", "stories:260k")
    assert res.returncode == 0 and "file kept" in res.stderr
    assert stories.exists()
    _one_line_error(cli("show", "stories:260k"), 1, "not installed")


def test_doctor(cli) -> None:
    res = cli("doctor", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["engines"]["llama.cpp"]["available"] is True
    assert "AVX" in report["engines"]["llama.cpp"]["system_info"] or "NEON" in report["engines"]["llama.cpp"]["system_info"]
    assert report["ram_total_bytes"] > 0 and report["packages"]["llama-cpp-python"]
    # What each engine can do, as its class declares it (the CLI's choices and messages read the same).
    assert report["engines"]["llama.cpp"]["abilities"] == ["request adapters", "expert offload", "embeddings",
                                                           "images", "drafting", "structured output"]
    text = cli("doctor").stdout
    assert "gpu offload" in text and "abilities   request adapters, expert offload, embeddings" in text


def test_help_is_fast_path(cli) -> None:
    res = cli("--help")
    assert res.returncode == 0 and "run" in res.stdout and "doctor" in res.stdout


class Terminal:
    """The real CLI in a pseudo-terminal, as a person types into it."""

    def __init__(self, *args: str) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            os.chdir(REPO)
            os.execv(sys.executable, [sys.executable, "-m", "localrun", *args])
        self.out = b""

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def expect(self, needle: str, timeout: float = 120, start: int = 0) -> str:
        """Wait until needle appears in the output after byte `start`."""
        end = time.monotonic() + timeout
        while needle.encode() not in self.out[start:]:
            left = end - time.monotonic()
            assert left > 0, f"did not see {needle!r} in {self.out.decode(errors='replace')!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                self.out += chunk
        assert needle.encode() in self.out[start:], self.out.decode(errors="replace")
        return self.out.decode(errors="replace")

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


STATS = re.compile(r"\[(\d+) prompt tokens in \d+ ms, (\d+) tokens at ")


def _turn(term: Terminal, text: str) -> tuple[str, int, int]:
    """Ask one question in the chat: (what was printed up to the next prompt, prompt tokens, reply tokens)."""
    start = len(term.out)
    term.send(text + "\r")
    term.expect(">>> ", start=start + len(text))
    printed = term.out[start:].decode(errors="replace")
    stats = STATS.findall(printed)
    assert len(stats) == 1, printed
    return printed.split(text, 1)[1], int(stats[0][0]), int(stats[0][1])


def test_interactive_chat_multi_turn_ctrl_c_and_ctrl_d() -> None:
    term = Terminal("run", "smollm2:135m", "--temperature", "0", "--verbose")
    term.expect(">>> ")
    first, p1, c1 = _turn(term, "What is the opposite of hot?")
    assert "cold" in first.lower()
    # The second turn sees the first: its prompt holds the first question and reply, and the reply
    # repeats the first one (asked alone, the model names a capital city instead).
    again = "Repeat your answer in capitals."
    second, p2, _ = _turn(term, again)
    assert p2 > p1 + c1
    assert "cold" in second.lower()
    before = len(term.out)
    term.send("Write a very long story about a dragon who learns to cook.\r")
    # Wait until the reply is streaming, then stop it with Ctrl-C.
    deadline = time.monotonic() + 60
    while len(term.out) < before + 200 and time.monotonic() < deadline:
        ready, _, _ = select.select([term.fd], [], [], 1)
        if ready:
            term.out += os.read(term.fd, 4096)
    term.send("\x03")
    term.expect("(stopped")
    term.expect(">>> ", start=term.out.rindex(b"(stopped"))
    term.send("/clear\r")
    term.expect("cleared")
    term.expect(">>> ", start=term.out.rindex(b"cleared"))  # Ctrl-D typed before the prompt is not EOF
    # After /clear the same question comes without the history.
    _, p3, _ = _turn(term, again)
    assert p3 < p2 - c1
    term.send("\x04")
    assert term.wait() == 0
