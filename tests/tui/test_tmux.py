"""Smoke runs of the real `localrun` binary in a real terminal (tmux): launch, chat, quit; and a
thinking model's thought in its block above the answer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from localrun import api
from tests.thinking_models import R1_TEMPLATE
from tui.conversations import ConversationStore

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent / "localrun"


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def wait_screen(session: str, condition: Callable[[str], bool], what: str, attempts: int = 600) -> str:
    """Poll the pane (bounded) until it shows what we wait for; the real terminal has no other signal."""
    screen = ""
    for _ in range(attempts):
        screen = tmux("capture-pane", "-p", "-t", session)
        if condition(screen):
            return screen
        time.sleep(0.2)  # polling an external terminal, not synchronising with our own code
    raise AssertionError(f"timed out waiting for {what}; the terminal shows:\n{screen}")


def launch(home: Path) -> str:
    """`localrun` alone (the TUI) on the store at home, in a new 80x24 tmux session; returns its name."""
    session = f"localrun-{uuid.uuid4().hex[:8]}"
    env = {"LOCALRUN_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": os.environ["HF_HUB_CACHE"],
           "TERM": "xterm-256color", "OMP_WAIT_POLICY": "PASSIVE"}
    exported = " ".join(f"{k}={v}" for k, v in env.items())
    # The shell prints a marker with the exit code when the app ends.
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", f"env {exported} {BIN}; echo EXITED-$?; sleep 60")
    return session


def test_localrun_binary_in_tmux(starter: Path, isolated_home: Path) -> None:
    assert shutil.which("tmux"), "tmux is required for this test: apt-get install -y tmux"
    assert BIN.exists(), f"the localrun console script is not installed at {BIN}"
    session = launch(isolated_home)
    try:
        screen = wait_screen(session, lambda s: "smollm2:135m" in s and "F2 Library" in s, "the library")
        assert "llama.cpp" in screen
        tmux("send-keys", "-t", session, "Enter")
        wait_screen(session, lambda s: "Message (Enter sends" in s, "the chat screen")
        tmux("send-keys", "-t", session, "-l", "What is the opposite of hot?")
        tmux("send-keys", "-t", session, "Enter")
        # the message shows in the conversation as it is sent (the input is empty again); a long
        # reply may scroll it out of the 24 rows later, so it is looked for first
        wait_screen(session, lambda s: "What is the opposite of hot?" in s and "Message (Enter sends" in s,
                    "the sent message")
        wait_screen(session, lambda s: "│ ready │" in s and "tok/s" in s, "the reply")
        tmux("send-keys", "-t", session, "C-c")
        screen = wait_screen(session, lambda s: "EXITED-" in s, "the app to quit")
        assert "EXITED-0" in screen and "Traceback" not in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)


def test_a_thought_in_its_block_above_the_answer_in_tmux(thinker: Callable[..., Path], isolated_home: Path) -> None:
    assert shutil.which("tmux"), "tmux is required for this test: apt-get install -y tmux"
    assert BIN.exists(), f"the localrun console script is not installed at {BIN}"
    # DeepSeek-R1's template opens the thought in the prompt: the tiny random model thinks until the
    # budget closes it, then answers. The TUI takes a budget from a conversation's own settings, so the
    # chat is a saved one to resume (the list shows chats that have an exchange).
    api.add_model(thinker(R1_TEMPLATE), "r1:tiny")
    store = ConversationStore()
    params = {"temperature": 1, "seed": 3, "max_tokens": 30, "think_budget": 6}
    cid = store.create("r1:tiny", given=params).id
    store.add_exchange(cid, "Hello there", "Hello.")
    session = launch(isolated_home)
    try:
        wait_screen(session, lambda s: "r1:tiny" in s and "F2 Library" in s, "the library")
        tmux("send-keys", "-t", session, "F4")
        wait_screen(session, lambda s: "Pick a model in the Library" in s, "the empty chat")
        tmux("send-keys", "-t", session, "C-o")
        wait_screen(session, lambda s: "Hello there" in s and "2 messages" in s, "the saved conversation")
        tmux("send-keys", "-t", session, "Enter")
        wait_screen(session, lambda s: "Hello." in s and "Message (Enter sends" in s, "the resumed chat")
        tmux("send-keys", "-t", session, "-l", "Why is the sky blue?")
        tmux("send-keys", "-t", session, "Enter")
        screen = wait_screen(session, lambda s: "│ ready │" in s and "tok/s" in s, "the reply")
        # The thought folded into its title line, the answer right below it.
        header = re.search(r"Thought for \d+\.\d s · 6 tokens", screen)
        assert header is not None, screen
        reply = store.get(cid).turns[-1]
        assert reply.thinking and reply.stats["thinking_tokens"] == 6
        words = re.findall(r"[A-Za-z]{4,}", reply.content)
        assert words and words[0] in screen[header.end():], (reply.content, screen)
        assert reply.thinking.strip() not in screen  # folded
        tmux("send-keys", "-t", session, "C-c")
        screen = wait_screen(session, lambda s: "EXITED-" in s, "the app to quit")
        assert "EXITED-0" in screen and "Traceback" not in screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=30)
