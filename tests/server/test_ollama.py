"""Ollama's API through ollama-python: chat, generate, load/unload, tags, show, ps, embed, pull,
delete, and its errors; `localrun ps` against the running server."""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from pathlib import Path

import ollama
import pytest

from localrun import api

from ..conftest import run_cli
from ..hub.repos import QUANT_REPO
from .conftest import MODEL, Served, serve

CHAT = [{"role": "user", "content": "What is the opposite of hot?"}]
GREEDY = {"temperature": 0, "num_predict": 12}


def test_chat_streams_ndjson_with_final_statistics(served: Served) -> None:
    client = served.ollama()
    parts = list(client.chat(model=MODEL, messages=CHAT, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    last = parts[-1]
    text = "".join(p.message.content for p in parts)
    assert "cold" in text.lower() and last.message.content == "" and last.message.role == "assistant"
    assert last.done_reason in ("stop", "length") and 0 < last.eval_count <= 12
    assert last.prompt_eval_count > 5 and last.eval_duration > 0 and last.prompt_eval_duration > 0
    assert last.total_duration >= last.eval_duration and last.load_duration is not None
    whole = client.chat(model=MODEL, messages=CHAT, options=GREEDY, stream=False)
    assert whole.done and whole.message.content == text and whole.eval_count == last.eval_count
    with served.http() as http:
        res = http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "options": GREEDY})
    assert res.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in res.text.splitlines()]
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])


def test_generate_raw_system_and_options(served: Served) -> None:
    client = served.ollama()
    raw = client.generate(model=MODEL, prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 3})
    assert raw.response.startswith(" Paris") and raw.done_reason == "length" and raw.eval_count == 3
    assert raw.prompt_eval_count == 5
    templated = client.generate(model=MODEL, prompt="What is the opposite of hot?", options=GREEDY)
    assert "cold" in templated.response.lower()
    system = client.generate(model=MODEL, prompt="What is the opposite of hot?", options=GREEDY,
                             system="Answer in French.")
    assert system.prompt_eval_count != templated.prompt_eval_count
    stopped = client.generate(model=MODEL, prompt="Count from 1 to 10, separated by commas.",
                              options={"temperature": 0, "stop": ["5"]})
    assert "4" in stopped.response and "5" not in stopped.response
    with pytest.raises(ollama.ResponseError, match="raw mode"):
        client.generate(model=MODEL, prompt="hi", raw=True, system="no")


def test_logprobs_and_nulls(served: Served) -> None:
    client = served.ollama()
    res = client.generate(model=MODEL, prompt="The capital of France is", raw=True, logprobs=True, top_logprobs=2,
                          options={"temperature": 0, "num_predict": 3, "presence_penalty": 0.5})
    assert len(res.logprobs) == 3 and "".join(t.token for t in res.logprobs) == res.response
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in res.logprobs)
    with served.http() as http:  # null means unset, as clients send it
        res = http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "options": None, "stream": None,
                                           "keep_alive": None, "format": None})
        assert res.status_code == 200 and json.loads(res.text.splitlines()[-1])["done"] is True


def test_empty_prompt_loads_and_keep_alive_zero_unloads(served: Served) -> None:
    client = served.ollama()
    loaded = client.generate(model=MODEL, prompt="", keep_alive="10m")
    assert loaded.done and loaded.done_reason == "load"
    ps = client.ps().models
    assert [m.model for m in ps] == [MODEL]
    ahead = ps[0].expires_at - datetime.now(timezone.utc)
    assert timedelta(minutes=9) < ahead <= timedelta(minutes=10)
    assert ps[0].context_length == 512 and ps[0].details.family == "llama" and ps[0].size > 0
    client.chat(model=MODEL, messages=[], keep_alive=-1)
    assert client.ps().models[0].expires_at - datetime.now(timezone.utc) > timedelta(days=365 * 100)
    unloaded = client.generate(model=MODEL, prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload" and client.ps().models == []
    unloaded = client.chat(model=MODEL, messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload"
    client.chat(model=MODEL, messages=[])  # loads it again for the other tests


def _own_copy(starter: Path, folder: Path) -> Path:
    """The starter file under another path (the store lists one name per file)."""
    import os
    import shutil

    copy = folder / "mini.gguf"
    try:
        os.link(starter, copy)
    except OSError:
        shutil.copyfile(starter, copy)
    return copy


def test_tags_show_and_latest_tag(served: Served, starter: Path, tmp_path: Path) -> None:
    api.add_model(_own_copy(starter, tmp_path), name="mini")  # a store name without a tag
    client = served.ollama()
    tags = {m.model: m for m in client.list().models}
    assert {MODEL, "mini:latest"} <= set(tags)
    assert tags[MODEL].details.format == "gguf" and tags[MODEL].details.quantization_level == "Q4_1"
    assert tags[MODEL].details.parameter_size == "135M" and tags[MODEL].size > 50_000_000
    assert tags[MODEL].modified_at is not None and len(tags[MODEL].digest) == 64
    info = client.show("mini:latest")
    assert info.details.family == "llama" and info.capabilities == ["completion", "tools", "embedding"]
    assert info.modelinfo["general.architecture"] == "llama" and info.modelinfo["llama.context_length"] == 8192
    assert "<|im_start|>" in info.template and "temperature" in info.parameters
    assert client.show("mini").details.family == "llama"
    with served.http() as http:  # older clients send `name`
        assert http.post("/api/show", json={"name": "mini"}).json()["details"]["family"] == "llama"
    out = client.generate(model="mini:latest", prompt="The capital of France is", raw=True,
                          options={"temperature": 0, "num_predict": 2})
    assert out.response.startswith(" Paris")


def test_embed_and_legacy_embeddings(served: Served) -> None:
    client = served.ollama()
    res = client.embed(model=MODEL, input=["hello there", "goodbye"])
    assert len(res.embeddings) == 2 and len(res.embeddings[0]) == 576
    assert abs(math.sqrt(sum(x * x for x in res.embeddings[0])) - 1) < 1e-3
    assert res.prompt_eval_count > 0 and res.total_duration > 0
    one = client.embed(model=MODEL, input="hello there", dimensions=32)
    assert len(one.embeddings[0]) == 32
    legacy = client.embeddings(model=MODEL, prompt="hello there")
    assert len(legacy.embedding) == 576
    assert client.embed(model=MODEL, input="").embeddings == []
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL, input="word " * 700)
    assert e.value.status_code == 400 and "context" in e.value.error


def test_errors_in_ollama_shape(served: Served, starter: Path) -> None:
    client = served.ollama()
    for name in ("no-such:7b", str(starter), "../models/x.gguf"):
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model=name, messages=CHAT)
        assert e.value.status_code == 404 and "not installed" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=MODEL, prompt="word " * 700)
    assert e.value.status_code == 400 and "context" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        list(client.chat(model=MODEL, messages=[{"role": "user", "content": "word " * 700}], stream=True))
    assert e.value.status_code == 400
    with served.http() as http:
        res = http.post("/api/chat", content=b'{"model": ')
        assert res.status_code == 400 and "not valid JSON" in res.json()["error"]
        res = http.post("/api/generate", json={"prompt": "hi"})
        assert res.status_code == 400 and res.json() == {"error": "model is required; send the model name, e.g. \"model\": \"smollm2:135m\""}
        res = http.post("/api/generate", json={"model": MODEL, "prompt": "hi", "options": {"temperature": -1}})
        assert res.status_code == 400 and "temperature" in res.json()["error"]
        res = http.post("/api/chat", json={"model": MODEL, "messages": CHAT, "keep_alive": "soon"})
        assert res.status_code == 400 and "keep_alive" in res.json()["error"]
        # curl -d sends a form content type; the body is still read as JSON, as Ollama does.
        res = http.post("/api/generate", content=json.dumps({"model": MODEL, "prompt": "Hi", "stream": False,
                                                            "options": {"num_predict": 1}}),
                        headers={"content-type": "application/x-www-form-urlencoded"})
        assert res.status_code == 200 and res.json()["done"] is True
        assert http.get("/api/nothing").json() == {"error": "no such endpoint: GET /api/nothing"}
    # An image for a text-only model is refused before the model loads, naming the model (as Ollama does).
    from tests.test_images import png

    for call in (lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "what?", "images": [png(28, 28)]}]),
                 lambda: client.generate(model=MODEL, prompt="what?", images=[png(28, 28)])):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and f"'{MODEL}' does not support images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "what?", "images": [b"%PDF-1.4"]}])
    assert e.value.status_code == 400 and "message 0: image 1 is not an image localrun can read" in e.value.error


def test_version_root_and_localrun_ps(served: Served) -> None:
    with served.http() as http:
        version = http.get("/api/version").json()["version"]
        assert tuple(int(x) for x in version.split(".")) >= (0, 6, 0)
        assert http.get("/").status_code == 200 and http.head("/").status_code == 200
    served.ollama().generate(model=MODEL, prompt="", keep_alive="1h")
    res = run_cli("ps", "--port", str(served.port))
    assert res.returncode == 0, res.stderr
    header, row = res.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "SIZE", "CONTEXT", "UNTIL"]
    assert row.split()[0] == MODEL and "512" in row and ("in 59m" in row or "in 1h00m" in row)
    res = run_cli("ps", "--port", str(served.port), "--json")
    assert json.loads(res.stdout)["models"][0]["name"] == MODEL


def test_ps_without_a_server() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = run_cli("ps", "--port", str(port))
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip() == f"localrun: no server is listening on 127.0.0.1:{port}; start one with 'localrun serve', or pass --host/--port"


def test_pull_from_the_hub_streams_status_then_delete(served: Served, hub: object) -> None:
    client = served.ollama()
    statuses = [p.status for p in client.pull(f"hf.co/{QUANT_REPO}:Q4_K_M", stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert any(s.startswith("pulling stories-260k-Q4_K_M.gguf") for s in statuses)
    name = "stories-260k:q4_k_m"
    assert name in {m.model for m in client.list().models}
    out = client.generate(model=name, prompt="Once upon a time", raw=True, options={"num_predict": 4})
    assert out.eval_count == 4
    again = client.pull(QUANT_REPO, stream=False)  # the default quantization, already installed
    assert again.status == "success"
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("test/No-Such-Repo-GGUF")
    assert e.value.status_code in (404, 502) and "No-Such-Repo" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3.2")
    assert e.value.status_code == 400 and "Hugging Face" in e.value.error

    assert client.delete(name).status == "success"
    assert name not in {m.model for m in client.list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(name)
    assert e.value.status_code == 404


def test_pull_is_refused_beyond_loopback() -> None:
    # Bound to 127.0.0.1 for the test, configured as a server listening on every interface.
    with serve(host="0.0.0.0") as s, s.http() as http:
        res = http.post("/api/pull", json={"model": QUANT_REPO})
        assert res.status_code == 403 and "--allow-pull" in res.json()["error"]
        # Beyond loopback the Host check is off (Ollama's rule): the address was chosen on purpose.
        assert http.get("/api/version", headers={"host": "models.example:11434"}).status_code == 200
