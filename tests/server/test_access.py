"""Who may talk to the server: the API key (with /health public), the Host allowlist against DNS
rebinding, CORS, the body size limit; and the `localrun serve` command itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import ollama
import openai
import pytest

from tests.conftest import serve_command

from .conftest import MODEL, Served, serve

KEY = "sk-local-test"


@pytest.fixture(scope="module")
def locked() -> Iterator[Served]:
    """A server with an API key, an extra CORS origin and a small body limit; no model is loaded."""
    with serve(api_key=KEY, origins=("https://app.example", "https://*.tools.example"), max_body=4096) as s:
        yield s


def test_api_key_is_required_but_health_is_public(locked: Served) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        locked.openai(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    assert MODEL in [m.id for m in locked.openai(api_key=KEY).models.list()]
    with pytest.raises(ollama.ResponseError) as o:
        locked.ollama().list()
    assert o.value.status_code == 401 and "API key" in o.value.error
    assert MODEL in [m.model for m in locked.ollama(headers={"Authorization": f"Bearer {KEY}"}).list().models]
    with locked.http() as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.get("/api/version").status_code == 401
        assert http.get("/api/version", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_foreign_host_header_is_refused(locked: Served) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with locked.http() as http:
        for host in ("evil.example", "evil.example:11434", "localhost.evil.example", "8.8.8.8"):
            res = http.get("/api/tags", headers={**auth, "host": host})
            assert res.status_code == 403, host
            assert res.json() == {"error": f"host '{host}' is not allowed"}
        res = http.get("/v1/models", headers={**auth, "host": "evil.example"})
        assert res.status_code == 403 and res.json()["error"]["type"] == "permission_error"
        for host in ("localhost", f"localhost:{locked.port}", "127.0.0.1", f"[::1]:{locked.port}", "192.168.1.20",
                     "box.local", "dev.localhost", socket.gethostname()):
            assert http.get("/api/version", headers={**auth, "host": host}).status_code == 200, host


def test_cors_allows_localhost_and_configured_origins(locked: Served) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    with locked.http() as http:
        for origin in ("http://localhost:3000", "http://127.0.0.1:8080", "https://app.example",
                       "https://ui.tools.example", "vscode-webview://abc"):
            res = http.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
            assert res.status_code == 200 and res.headers["access-control-allow-origin"] == origin, origin
        for origin in ("https://evil.example", "http://localhost.evil.example"):
            res = http.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
            assert res.status_code == 400 and "access-control-allow-origin" not in res.headers, origin
        res = http.get("/api/version", headers={"Origin": "http://localhost:5173", "Authorization": f"Bearer {KEY}"})
        assert res.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_body_size_limit(locked: Served) -> None:
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 8000}]}
    with locked.http(headers={"Authorization": f"Bearer {KEY}"}) as http:
        res = http.post("/v1/chat/completions", json=big)
        assert res.status_code == 413 and res.json()["error"]["code"] == "request_too_large"
        res = http.post("/api/chat", json=big)
        assert res.status_code == 413 and "larger than" in res.json()["error"]


def test_health_is_503_while_a_model_loads() -> None:
    from starlette.testclient import TestClient

    from localrun.server.app import ServerConfig, create_app

    class Loading:  # a pool in the middle of a load; only /health's logic is under test
        loading = True

    with TestClient(create_app(Loading(), ServerConfig(log=lambda r: None)), base_url="http://localhost") as http:
        res = http.get("/health")
    assert res.status_code == 503 and res.json() == {"status": "loading"}


def test_access_log_line(served: Served) -> None:
    mark = served.records.mark()
    served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0)
    record = served.records.wait(lambda r: r.path == "/v1/chat/completions", since=mark)
    line = record.line()
    assert line.startswith(f"POST /v1/chat/completions {MODEL} 200 4 tokens ") and " tok/s " in line


def _serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "localrun", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "LOCALRUN_API_KEY": ""})


def test_port_taken_is_one_line() -> None:
    with socket.socket() as other:  # another server on the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        proc = _serve("--port", str(port))
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and out == ""
    assert err == f"localrun: another server, perhaps Ollama, is listening on 127.0.0.1:{port}; use --port\n"


def test_serve_command_serves_and_stops_on_ctrl_c() -> None:
    import httpx

    with serve_command("--ctx", "256", "--parallel", "1") as (url, stopped):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/api/version").status_code == 200
            assert http.get("/api/tags", headers={"host": "evil.example"}).status_code == 403
            res = http.post("/api/generate", json={"model": MODEL, "prompt": "The capital of France is", "raw": True,
                                                   "stream": False, "options": {"temperature": 0, "num_predict": 2}})
            assert res.json()["response"].startswith(" Paris")
    assert stopped.returncode == 0 and stopped.out == ""
    lines = stopped.err.splitlines()
    assert any(x.startswith(f"POST /api/generate {MODEL} 200 2 tokens") for x in lines), stopped.err
    assert "Traceback" not in stopped.err


def test_serve_warns_beyond_loopback() -> None:
    proc = _serve("--host", "0.0.0.0", "--port", "0")
    try:
        assert proc.stderr is not None
        warning = proc.stderr.readline()
        assert warning.startswith("localrun: warning: listening on 0.0.0.0 makes your models reachable"), warning
        assert "--api-key" in warning
        assert proc.stderr.readline().startswith("localrun: serving on http://0.0.0.0:")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_ps_json_shape_is_ollamas(served: Served) -> None:
    served.ollama().generate(model=MODEL, prompt="")
    with served.http() as http:
        models = http.get("/api/ps").json()["models"]
    # Ollama's fields, and localrun's kv_cache_type (clients ignore a field they do not know)
    assert set(models[0]) == {"name", "model", "size", "digest", "details", "expires_at", "size_vram", "context_length",
                              "kv_cache_type"}
    assert json.dumps(models)
