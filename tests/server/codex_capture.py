"""The real Codex CLI as the tests run it: its environment (a CODEX_HOME of its own, localrun's
provider and catalog as `localrun launch` writes them), the options that narrow its prompt to the
starter model's 8192-token context, and the first request it sends, recorded once by a bare HTTP
endpoint so that tests use Codex's own tools (its apply_patch grammar) without copying them."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from localrun import agents
from tests.agents import agent_or_fail, record_requests

MODEL = "smollm2:135m"
# The starter holds 8192 tokens; Codex's default first request is about 9.1k. Its own options make
# it fit: short instructions (an example patch, which the tiny model copies), no sub-agents, goals or
# web search. With shell_tool off, apply_patch is the tool left to edit with.
INSTRUCTIONS = ("You edit files with the apply_patch tool. Example: to create the file hello.txt containing the "
                "line hello world, call apply_patch with:\n*** Begin Patch\n*** Add File: hello.txt\n+hello world\n"
                "*** End Patch\n")
NARROW = ["-c", "agents.enabled=false", "-c", "features.goals=false", "-c", 'web_search="disabled"']
EDIT_ONLY = ["-c", "features.shell_tool=false"]


def codex_env(home: Path) -> dict[str, str]:
    """The environment Codex runs in: its own CODEX_HOME (no user config), the agent tests' binary."""
    home.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "CODEX_HOME": str(home), "LOCALRUN_CODEX": str(agent_or_fail("codex")),
            "NO_COLOR": "1"}


def instructions_file(folder: Path) -> Path:
    path = folder / "instructions.md"
    path.write_text(INSTRUCTIONS)
    return path


@functools.lru_cache(maxsize=1)
def codex_request() -> dict[str, Any]:
    """The body of the first request Codex sends for this model, configured as `localrun launch`
    configures it (so its catalog declares apply_patch as a freeform tool)."""
    codex = str(agent_or_fail("codex"))

    def run(url: str, folder: Path) -> None:
        args, _ = agents.codex_setup(codex, url, MODEL, 8192, False, False, folder / "catalog")
        work = folder / "work"
        work.mkdir()
        subprocess.run([codex, *args, "exec", "--skip-git-repo-check", "--ephemeral", *NARROW, *EDIT_ONLY,
                        "-c", f"model_instructions_file={json.dumps(str(instructions_file(folder)))}", "hi"],
                       cwd=work, env=codex_env(folder / "home"), stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=300)

    bodies = [body for _, body in record_requests(run)]
    assert bodies, "Codex sent no request"
    return dict(bodies[0])
