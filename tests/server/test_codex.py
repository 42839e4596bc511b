"""The real Codex CLI (`@openai/codex`, installed by `make agents`) against the real `localrun serve`,
started with `localrun launch codex` as a user starts it: its configuration, a patch the starter
model writes and Codex applies to a scratch repository, and a prompt past the context, which
Codex reports as a full context window."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomllib

from tests.conftest import serve_command

from .codex_capture import EDIT_ONLY, MODEL, NARROW, codex_env, instructions_file


def _launch(port: str, *rest: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "localrun", "launch", "codex", MODEL, "--port", port, *rest],
                            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _events(proc: subprocess.Popen[str]) -> Iterator[dict[str, Any]]:
    """Codex's --json events as it prints them."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("{"):
            yield json.loads(line)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.communicate(timeout=60)


@pytest.fixture
def request_cleanup() -> Iterator[Any]:
    """Folders removed when the test ends."""
    made: list[Path] = []
    yield made.append
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def test_launch_config_is_one_codex_reads(tmp_path: Path) -> None:
    env = codex_env(tmp_path / "codex-home")
    out = subprocess.run([sys.executable, "-m", "localrun", "launch", "codex", MODEL, "--port", "18434", "--config"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config = tomllib.loads(out.stdout)
    assert config["model"] == MODEL and config["model_provider"] == "localrun"
    assert config["model_providers"]["localrun"] == {"name": "localrun", "base_url": "http://127.0.0.1:18434/v1",
                                                       "wire_api": "responses"}
    # the starter holds 8192 tokens, less than Codex's first request: said before anything starts
    assert "codex's first request is about 9100 tokens and this model holds 8192" in out.stderr
    (entry,) = json.loads(Path(config["model_catalog_json"]).read_text())["models"]
    assert (entry["slug"], entry["context_window"], entry["apply_patch_tool_type"]) == (MODEL, 8192, "freeform")
    assert entry["input_modalities"] == ["text"] and entry["supported_reasoning_levels"] == []
    # Codex itself reads it: its catalog for this config is the entry
    shown = subprocess.run([env["LOCALRUN_CODEX"], "-c", f"model_catalog_json={json.dumps(config['model_catalog_json'])}",
                            "debug", "models"], env=env, capture_output=True, text=True, timeout=120)
    assert [m["slug"] for m in json.loads(shown.stdout)["models"]] == [MODEL]


def test_codex_applies_the_patch_the_local_model_writes(tmp_path: Path, request_cleanup: Any) -> None:
    """Codex declares apply_patch as a freeform tool with its Lark grammar (the catalog says the
    model takes one); the server constrains the call's input by that grammar, and Codex applies
    the patch. The tiny model keeps calling tools after it, so the test stops Codex once the
    change is applied (Codex's own file_change event). The repository's path is short and fixed:
    Codex puts it in the prompt, and the tiny model copies what it sees."""
    repo = Path(tempfile.gettempdir()) / "localrun-codex"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir()
    request_cleanup(repo)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    env = codex_env(tmp_path / "codex-home")
    with serve_command("--ctx", "8192", "--parallel", "1", "--temperature", "0") as (url, _):
        port = url.rsplit(":", 1)[1]
        proc = _launch(port, "--", "exec", "--skip-git-repo-check", "-s", "workspace-write", "--ephemeral", "--json",
                       *NARROW, *EDIT_ONLY, "-c", f"model_instructions_file={json.dumps(str(instructions_file(tmp_path)))}",
                       "Create hello.txt containing hello world", cwd=repo, env=env)
        try:
            change = next(e["item"] for e in _events(proc)
                          if e["type"] == "item.completed" and e["item"]["type"] == "file_change")
        finally:
            _stop(proc)
    assert change["status"] == "completed", change
    (made,) = change["changes"]
    path = Path(made["path"])
    assert made["kind"] == "add" and path.parent == repo and path.read_text().strip()


def test_a_prompt_past_the_context_is_a_full_window_to_codex(tmp_path: Path) -> None:
    """Codex's own prompt (about 9.1k tokens) on the starter's 8192: context_length_exceeded in
    the stream, which Codex reads as its context window being full (it compacts when it can)."""
    env = codex_env(tmp_path / "codex-home")
    with serve_command("--ctx", "8192", "--parallel", "1") as (url, _):
        proc = _launch(url.rsplit(":", 1)[1], "--", "exec", "--skip-git-repo-check", "--ephemeral", "--json", "hi",
                       cwd=tmp_path, env=env)
        try:
            failed = next(e for e in _events(proc) if e["type"] == "turn.failed")
        finally:
            _stop(proc)
    assert "ran out of room in the model's context window" in failed["error"]["message"]


def test_codex_oss_takes_localrun_for_ollama(tmp_path: Path) -> None:
    """`codex --oss` checks the Ollama version (/api/version: 0.13.4 or newer, for its Responses
    API), lists the models, then sends its requests: it gets as far as the model's context."""
    env = codex_env(tmp_path / "codex-home")
    with serve_command("--ctx", "8192", "--parallel", "1") as (url, _):
        out = subprocess.run([env["LOCALRUN_CODEX"], "exec", "--oss", "--local-provider", "ollama", "-m", MODEL,
                              "--skip-git-repo-check", "--ephemeral", "--json", "hi"],
                             cwd=tmp_path, env={**env, "CODEX_OSS_BASE_URL": f"{url}/v1"}, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, timeout=300)
    failed = [json.loads(line) for line in out.stdout.splitlines() if '"turn.failed"' in line]
    assert failed, out.stdout + out.stderr  # a version it refuses ends before any turn
    assert "ran out of room in the model's context window" in failed[0]["error"]["message"]
