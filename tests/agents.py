"""The real coding agents, installed by `make agents` from npm (Codex CLI, Claude Code): where they
are, and Codex's own apply_patch, which the Codex binary runs when it is called by that name."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import REPO, skip_or_fail

BIN = REPO / ".agents" / "node_modules" / ".bin"


def agent_or_fail(name: str) -> Path:
    """An agent's command (codex, claude): $LOCALRUN_<NAME> or the one `make agents` installed."""
    path = Path(os.environ.get(f"LOCALRUN_{name.upper()}") or BIN / name)
    if not path.exists():
        skip_or_fail(f"{name} is not installed at {path}: run 'make agents' (npm, Node.js 20)")
    return path


def codex_native() -> Path:
    """The Codex binary itself (the npm package's launcher runs it)."""
    agent_or_fail("codex")
    found = sorted((REPO / ".agents" / "node_modules" / "@openai").glob("codex-*/vendor/*/bin/codex"))
    if not found:
        skip_or_fail("the Codex package has no binary for this platform")
    return found[0]


def apply_patch(patch: str, repo: Path) -> subprocess.CompletedProcess[str]:
    """Codex's own apply_patch on `repo`: its parser and applier, as Codex runs them for a call."""
    tool = repo.parent / "apply_patch"
    if not tool.exists():
        tool.symlink_to(codex_native())
    return subprocess.run([str(tool), patch], cwd=repo, capture_output=True, text=True, timeout=60)


def record_requests(run: Callable[[str, Path], None]) -> list[tuple[str, dict[str, Any]]]:
    """Run an agent (`run(url, scratch folder)`) against a bare endpoint that records each POST
    (path, JSON body, zstd bodies decompressed) and answers 400 in both OpenAI's and Anthropic's
    error shape: the requests an agent sends, as it sends them."""
    bodies: list[tuple[str, dict[str, Any]]] = []

    class Record(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.headers.get("content-encoding") == "zstd":
                import zstandard

                raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
            bodies.append((self.path, json.loads(raw)))
            self.send_response(400)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "error", "error": {"message": "recorded", "type": "invalid_request_error",'
                             b' "code": null}}')

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with tempfile.TemporaryDirectory(prefix="agent-requests-") as tmp:
            run(f"http://127.0.0.1:{server.server_address[1]}", Path(tmp))
    finally:
        server.shutdown()
    return bodies
