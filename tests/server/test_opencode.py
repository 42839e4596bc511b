"""The real OpenCode (`opencode-ai`, installed by `make agents`) against the real `localrun serve`,
run with `localrun launch opencode` as a user runs it (`opencode run`, no network but localhost):
the configuration it is given is one OpenCode reads, and a reply completes, with OpenCode's title
request and its turn answered by the server. With its own options, OpenCode's tools are off (a
project opencode.json: the tiny model would call them without end) and its replies capped
(OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX: it asks for 2048 tokens, which the tiny model fills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.agents import agent_or_fail
from tests.conftest import serve_command

MODEL = "smollm2:135m"
NO_TOOLS = {"tools": {"*": False}}


def _env(home: Path) -> dict[str, str]:
    return {"HOME": str(home), "PATH": "/usr/bin:/bin", "LOCALRUN_OPENCODE": str(agent_or_fail("opencode")),
            "LOCALRUN_HOME": os.environ["LOCALRUN_HOME"], "NO_COLOR": "1", "OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX": "64"}


def _launch(port: str, home: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localrun", "launch", "opencode", MODEL, "--port", port, "--", *args],
                          cwd=cwd, env=_env(home), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=500)


def test_the_configuration_is_one_opencode_reads(tmp_path: Path) -> None:
    printed = subprocess.run([sys.executable, "-m", "localrun", "launch", "opencode", MODEL, "--port", "18444",
                              "--config"], env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0, printed.stderr
    config = json.loads(printed.stdout)
    assert config["model"] == f"localrun/{MODEL}"
    assert config["provider"]["localrun"]["options"]["baseURL"] == "http://127.0.0.1:18444/v1"
    assert config["provider"]["localrun"]["models"][MODEL]["limit"]["context"] == 8192  # the starter's trained context
    # OpenCode lists the model from the configuration launch gives it
    listed = _launch("18444", tmp_path / "home", tmp_path, "models", "localrun")
    assert listed.returncode == 0 and f"localrun/{MODEL}" in listed.stdout.split(), listed.stdout + listed.stderr


def test_a_reply_completes_with_its_title_request(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "opencode.json").write_text(json.dumps(NO_TOOLS))
    with serve_command("--ctx", "8192", "--parallel", "2", "--temperature", "0") as (url, stopped):
        out = _launch(url.rsplit(":", 1)[1], tmp_path / "home", work, "run", "What is the opposite of hot?",
                      "--format", "json")
    events: list[dict[str, Any]] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and events, out.stdout[-2000:] + out.stderr[-2000:]
    assert not [e for e in events if e.get("type") == "error"], events
    texts = [e["part"]["text"] for e in events if e.get("type") == "text"]
    assert texts and "cold" in texts[0].lower(), events
    served = [line for line in stopped.err.splitlines() if "/v1/chat/completions" in line]
    assert len(served) >= 2 and all(" 200 " in line for line in served), stopped.err[-3000:]  # its title, its turn
