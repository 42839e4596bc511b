"""A smoke run of the real `localrun` binary in a real terminal (tmux): launch, chat, quit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

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


def test_localrun_binary_in_tmux(starter: Path, isolated_home: Path) -> None:
    assert shutil.which("tmux"), "tmux is required for this test: apt-get install -y tmux"
    assert BIN.exists(), f"the localrun console script is not installed at {BIN}"
    session = f"localrun-{uuid.uuid4().hex[:8]}"
    env = {"LOCALRUN_HOME": str(isolated_home), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": os.environ["HF_HUB_CACHE"],
           "TERM": "xterm-256color", "OMP_WAIT_POLICY": "PASSIVE"}
    exported = " ".join(f"{k}={v}" for k, v in env.items())
    # `localrun` with no arguments opens the TUI; the shell prints a marker with its exit code.
    cmd = f"env {exported} {BIN}; echo EXITED-$?; sleep 60"
    tmux("new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd)
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
