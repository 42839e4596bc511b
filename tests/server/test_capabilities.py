"""Capabilities as clients read them: /api/show through ollama-python, a chat with tools through
it, and the `llm` CLI with its Ollama plugin, which sends tools only to a model whose
capabilities list them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from localrun import api
from localrun.capabilities import capabilities
from localrun.store import ModelInfo

from .conftest import MODEL, Served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


def test_show_lists_tools_and_a_tool_chat_through_ollama_python(served: Served) -> None:
    client = served.ollama()
    info = client.show(MODEL)
    # localrun's generic tool format serves tools on a template without tool syntax (the starter's),
    # and llama.cpp pools any model into an embedding; fill-in-the-middle is not served.
    assert info.capabilities == ["completion", "tools", "embedding"]
    out = client.chat(model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                      tools=[WEATHER], options={"temperature": 0, "num_predict": 40})
    calls = out.message.tool_calls or []
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_llm_cli_with_the_ollama_plugin_sends_tools(served: Served, tmp_path: Path) -> None:
    llm = shutil.which("llm", path=str(Path(sys.executable).parent))
    assert llm, "the llm CLI is missing: install the dev extra (pip install -e '.[dev]')"
    env = {**os.environ, "OLLAMA_HOST": served.url, "LLM_USER_PATH": str(tmp_path / "llm")}
    # llm-ollama reads /api/show's capabilities and refuses tools ("does not support tools")
    # unless they list them; the small model calls the tool again after its result, so the
    # second reply ends the chain at its limit.
    res = subprocess.run([llm, "-m", f"ollama/{MODEL}", "-T", "llm_version", "--td", "--cl", "2",
                          "-o", "temperature", "0", "-o", "num_predict", "40", "What version of llm is this?"],
                         env=env, capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert "does not support tools" not in out
    assert "Tool call: llm_version({})" in out, out


def _model(fmt: str, architecture: str, metadata: dict[str, object] | None = None) -> ModelInfo:
    return ModelInfo("m:1", "/nowhere", fmt, "path", 1, architecture, details={"metadata": metadata or {}})


def test_capabilities_follow_the_model_and_the_engine_abilities() -> None:
    from localrun.backends.base import backend_class

    llama = backend_class("llama.cpp").abilities
    assert capabilities(_model("gguf", "llama"), llama) == ("completion", "tools", "embedding")
    assert capabilities(_model("gguf", "bert"), llama) == ("embedding",)
    assert capabilities(_model("gguf", "qwen3", {"qwen3.pooling_type": 3}), llama) == ("embedding",)
    # MLX has no embedding mode; a model with no engine installed still generates and takes tools.
    assert api.capabilities(_model("mlx", "LlamaForCausalLM")) == ("completion", "tools")
    assert capabilities(_model("mlx", "LlamaForCausalLM"), None) == ("completion", "tools")


def test_show_prints_the_capabilities_and_the_context(cli, starter: Path) -> None:
    res = cli("show", MODEL)
    assert res.returncode == 0, res.stderr
    lines = {line[:16].strip(): line[16:] for line in res.stdout.splitlines() if line[:1].strip()}
    assert lines["capabilities"] == "completion, tools, embedding"
    assert lines["context"] == "8192 (trained 8192; fits in memory)"
    res = cli("show", MODEL, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["capabilities"] == ["completion", "tools", "embedding"]
    assert out["context"] == {"tokens": 8192, "trained": 8192, "sequences": 1, "reason": "fits in memory"}
