"""`localrun add --from ollama|lmstudio|hf`: models other tools downloaded, registered in place.

Each test builds the other tool's folder on disk as that tool writes it (Ollama: manifests and
sha256-named blobs with its media types; LM Studio: publisher/repo/file.gguf; the Hugging Face
hub cache: blobs and snapshot links) from the test models, and imports it through the real CLI.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.store import dir_size

from .conftest import run_cli

SYSTEM = "You are a pirate. Answer every question in one short sentence."
# ChatML as Ollama's library writes it in Go's template language (system messages go to .System).
CHATML = """{{- if .Messages }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 -}}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ .Content }}{{ if not $last }}<|im_end|>
{{ end }}
{{- end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}
{{- else }}
{{- if .System }}<|im_start|>system
{{ .System }}<|im_end|>
{{ end }}{{ if .Prompt }}<|im_start|>user
{{ .Prompt }}<|im_end|>
{{ end }}<|im_start|>assistant
{{ .Response }}{{ if .Response }}<|im_end|>{{ end }}
{{- end }}"""
MEDIA = "application/vnd.ollama.image."
SMOL = "smollm2:135m-instruct-q4_1"  # the localrun name of registry.ollama.ai/library/smollm2:135m-instruct-q4_1
STORIES = "hf.co/someone/stories260k-gguf:f32"  # of hf.co/someone/Stories260K-GGUF:F32


@functools.cache
def _digest(path: Path) -> str:
    """A model file's sha256, hashed once a session."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class OllamaStore:
    """An Ollama models folder (manifests/HOST/NAMESPACE/MODEL/TAG, blobs/sha256-HEX) built on disk."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs").mkdir(parents=True, exist_ok=True)

    def blob(self, content: bytes | Path) -> dict[str, Any]:
        """Store content as a blob (a model file is linked, not copied); its layer without the media type."""
        if isinstance(content, Path):
            hexdigest, size = _digest(content), content.stat().st_size
        else:
            hexdigest, size = hashlib.sha256(content).hexdigest(), len(content)
        path = self.root / "blobs" / f"sha256-{hexdigest}"
        if not path.exists():
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                try:
                    os.link(content, path)
                except OSError:
                    path.symlink_to(content)
        return {"digest": f"sha256:{hexdigest}", "size": size}

    def path(self, layer: dict[str, Any]) -> Path:
        return self.root / "blobs" / layer["digest"].replace(":", "-")

    def model(self, name: str, model: Path | bytes | None, *, template: str | None = None,
              system: str | None = None, params: dict[str, Any] | None = None, license: str | None = None,
              messages: list[dict[str, str]] | None = None, projector: bytes | None = None,
              config: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Write one model's manifest (name: HOST/NAMESPACE/MODEL:TAG); returns its layers by kind."""
        layers: dict[str, dict[str, Any]] = {}
        if model is not None:
            layers["model"] = self.blob(model)
        if projector is not None:
            layers["projector"] = self.blob(projector)
        for kind, text in (("template", template), ("system", system), ("license", license)):
            if text is not None:
                layers[kind] = self.blob(text.encode())
        for kind, value in (("params", params), ("messages", messages)):
            if value is not None:
                layers[kind] = self.blob(json.dumps(value).encode())
        cfg = {"model_format": "gguf", "model_family": "llama", "model_families": ["llama"], "file_type": "Q4_1",
               "architecture": "amd64", "os": "linux",
               "rootfs": {"type": "layers", "diff_ids": [x["digest"] for x in layers.values()]}, **(config or {})}
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                       **self.blob(json.dumps(cfg).encode())},
            "layers": [{"mediaType": MEDIA + kind, **layer} for kind, layer in layers.items()],
        }
        where, tag = name.rsplit(":", 1)
        path = self.root / "manifests" / where / tag
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(manifest))
        return layers


def _json(*args: str) -> Any:
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {i["name"]: i for i in result["imported"]}


@pytest.fixture
def ollama(tmp_path: Path, starter: Path, stories: Path) -> tuple[OllamaStore, dict[str, dict[str, Any]]]:
    """An Ollama store: SmolLM2 with Ollama's settings, a model pulled from hf.co whose template
    cannot be translated, a truncated blob and a cloud model."""
    store = OllamaStore(tmp_path / "ollama")
    smol = store.model(
        "registry.ollama.ai/library/smollm2:135m-instruct-q4_1", starter, template=CHATML, system=SYSTEM,
        params={"temperature": 0.2, "stop": ["<|im_start|>", "<|im_end|>"], "num_ctx": 1024, "mirostat": 0},
        license="Apache License\nVersion 2.0, January 2004")
    hf = store.model("hf.co/someone/Stories260K-GGUF:F32", stories.read_bytes(),
                     template="{{ with .System }}{{ . }} {{ end }}{{ .Prompt }}", projector=b"GGUF projector",
                     messages=[{"role": "user", "content": "Ahoy"}, {"role": "assistant", "content": "Arr!"},
                               {"role": "tool", "content": "{}"}])
    store.model("registry.ollama.ai/library/broken:latest", stories.read_bytes()[:600_000])
    store.model("registry.ollama.ai/library/big:cloud", None, config={"remote_host": "https://ollama.com:443"})
    return store, {"smol": smol, "hf": hf}


def test_ollama_models_run_in_place_with_their_settings(ollama, isolated_home: Path) -> None:
    store, layers = ollama
    result = _json("add", "--from", "ollama", "--path", str(store.root), "--json")
    got = _by_name(result)
    assert set(got) == {SMOL, STORIES}
    smol_blob, hf_blob = str(store.path(layers["smol"]["model"])), str(store.path(layers["hf"]["model"]))
    assert got[SMOL]["path"] == smol_blob and got[SMOL]["base"] == f"ollama/{SMOL}"
    assert got[SMOL]["origin"] == "registry.ollama.ai/library/smollm2:135m-instruct-q4_1"
    assert any("mirostat" in n and "not supported" in n for n in got[SMOL]["notes"])
    assert any("TEMPLATE is not used" in n and "no chat template" in n and "with" in n for n in got[STORIES]["notes"])
    assert any("role 'tool' is left out" in n for n in got[STORIES]["notes"])
    skipped = {s["origin"]: s["reason"] for s in result["skipped"]}
    assert "truncated" in skipped["registry.ollama.ai/library/broken:latest"]
    assert "cloud model" in skipped["registry.ollama.ai/library/big:cloud"]
    assert dir_size(isolated_home) < 1 << 20  # nothing of the models was copied

    shown = _json("show", SMOL, "--json")
    assert shown["path"] == smol_blob and shown["kind"] == "preset" and shown["architecture"] == "llama"
    registry = json.loads((isolated_home / "registry.json").read_text())["models"]
    assert registry[f"ollama/{STORIES}"]["mmproj"] == str(store.path(layers["hf"]["projector"]))
    assert registry[f"ollama/{STORIES}"]["path"] == hf_blob and registry[f"ollama/{STORIES}"]["source"] == "ollama"
    modelfile = run_cli("show", SMOL, "--modelfile").stdout
    for line in (f"FROM ollama/{SMOL}", "PARAMETER temperature 0.2", "PARAMETER stop <|im_end|>",
                 "PARAMETER num_ctx 1024", f"SYSTEM {SYSTEM}", 'TEMPLATE """{{- if .Messages }}', "LICENSE"):
        assert line in modelfile, modelfile
    assert "mirostat" not in modelfile
    other = run_cli("show", STORIES, "--modelfile").stdout
    assert "TEMPLATE" not in other and "MESSAGE user Ahoy\nMESSAGE assistant Arr!\n" in other

    # The preset renders Ollama's system prompt through its (translated) template, token for token
    # what the bare model gives with that system prompt passed by hand.
    request = api.resolve_target(SMOL).request(api.build_messages("Where is the treasure?"))
    assert [m.role for m in request.messages] == ["system", "user"] and request.messages[0].content == SYSTEM
    assert request.template and "Messages" in request.template and "<|im_start|>" in request.template
    args = ("Where is the treasure?", "--max-tokens", "5", "--temperature", "0", "--json")
    preset = _json("run", SMOL, *args)
    by_hand = _json("run", f"ollama/{SMOL}", *args, "--system", SYSTEM)
    assert preset["model"] == SMOL and preset["completion_tokens"] > 0
    assert preset["prompt_tokens"] == by_hand["prompt_tokens"] > 20
    assert preset["text"] == by_hand["text"]


def test_ollama_reimport_is_idempotent_and_deleted_models_show_missing(ollama, stories: Path,
                                                                       isolated_home: Path) -> None:
    store, layers = ollama
    hf_blob = store.path(layers["hf"]["model"])
    first = _json("add", "--from", "ollama", "--path", str(store.root), "--json")
    assert {i["status"] for i in first["imported"]} == {"added"}
    registry = isolated_home / "registry.json"
    before = json.loads(registry.read_text())["models"]
    again = _json("add", "--from", "ollama", "--path", str(store.root), "--json")
    assert {i["status"] for i in again["imported"]} == {"unchanged"} and again["missing"] == []
    assert json.loads(registry.read_text())["models"] == before
    assert sorted(before) == sorted([SMOL, f"ollama/{SMOL}", STORIES, f"ollama/{STORIES}"])

    # `ollama rm` deletes the manifest and the blobs no other model uses.
    (store.root / "manifests" / "hf.co" / "someone" / "Stories260K-GGUF" / "F32").unlink()
    hf_blob.unlink()
    listed = run_cli("list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
    assert "missing" in rows[STORIES] and "missing" in rows[f"ollama/{STORIES}"] and "missing" not in rows[SMOL]
    res = run_cli("run", STORIES, "hi")
    assert res.returncode == 1 and "gone" in res.stderr and "Traceback" not in res.stderr
    third = run_cli("add", "--from", "ollama", "--path", str(store.root))
    assert third.returncode == 0, third.stderr
    assert f"missing {STORIES}" in third.stderr and f"unchanged {SMOL}" in third.stderr

    # A new pull of a name (here: a blob the deleted model had) updates its entries in place.
    store.model("registry.ollama.ai/library/smollm2:135m-instruct-q4_1", stories, system="Talk like a parrot.")
    fourth = _json("add", "--from", "ollama", "--path", str(store.root), "--json")
    assert _by_name(fourth)[SMOL]["status"] == "updated" and _by_name(fourth)[SMOL]["path"] == str(hf_blob)
    assert fourth["missing"] == [STORIES, f"ollama/{STORIES}"]  # its manifest is still gone
    modelfile = run_cli("show", SMOL, "--modelfile").stdout
    assert "SYSTEM Talk like a parrot." in modelfile and "TEMPLATE" not in modelfile


def test_ollama_dry_run_registers_nothing(ollama, isolated_home: Path) -> None:
    store, _ = ollama
    result = _json("add", "--from", "ollama", "--path", str(store.root), "--dry-run", "--json")
    assert result["dry_run"] and {i["status"] for i in result["imported"]} == {"added"}
    assert not (isolated_home / "registry.json").exists()
    res = run_cli("add", "--from", "ollama", "--path", str(store.root / "nowhere"))
    assert res.returncode == 2 and "no Ollama models folder" in res.stderr and "--path" in res.stderr


def test_lmstudio_models_folder(tmp_path: Path, starter: Path, stories: Path, isolated_home: Path) -> None:
    root = tmp_path / "lmstudio"
    smol = root / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF"
    smol.mkdir(parents=True)
    os.symlink(starter, smol / "SmolLM2-135M-Instruct-Q4_1.gguf")
    (smol / "mmproj-SmolLM2-135M-Instruct-F16.gguf").write_bytes(b"GGUF projector")
    other = root / "someone" / "Stories"
    other.mkdir(parents=True)
    shutil.copy(stories, other / "stories260K.gguf")
    mlx = root / "mlx-community" / "Tiny-4bit"
    mlx.mkdir(parents=True)
    (mlx / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 "quantization": {"bits": 4, "group_size": 64}}))
    (mlx / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")

    result = _json("add", "--from", "lmstudio", "--path", str(root), "--json")
    got = _by_name(result)
    assert set(got) == {"lmstudio-community/smollm2-135m-instruct:q4_1", "someone/stories:latest",
                        "mlx-community/tiny-4bit:latest"}, result
    registry = json.loads((isolated_home / "registry.json").read_text())["models"]
    entry = registry["lmstudio-community/smollm2-135m-instruct:q4_1"]
    assert entry["path"] == str(smol / "SmolLM2-135M-Instruct-Q4_1.gguf") and entry["source"] == "lmstudio"
    assert entry["mmproj"] == str(smol / "mmproj-SmolLM2-135M-Instruct-F16.gguf")
    assert registry["mlx-community/tiny-4bit:latest"]["format"] == "mlx"
    assert dir_size(isolated_home) < 1 << 20
    again = _json("add", "--from", "lmstudio", "--path", str(root), "--json")
    assert {i["status"] for i in again["imported"]} == {"unchanged"}

    (other / "stories260K.gguf").unlink()  # deleted in LM Studio
    listed = run_cli("list")
    assert listed.returncode == 0 and "missing" in listed.stdout, listed.stderr
    assert _json("add", "--from", "lmstudio", "--path", str(root), "--json")["missing"] == ["someone/stories:latest"]
    res = run_cli("rm", "lmstudio-community/smollm2-135m-instruct:q4_1")
    assert res.returncode == 0 and "file kept" in res.stderr and (smol / "SmolLM2-135M-Instruct-Q4_1.gguf").exists()


def test_hf_cache_ggufs_become_registered_models(tmp_path: Path, stories: Path, isolated_home: Path) -> None:
    repo = tmp_path / "hf-cache" / "models--someone--Tiny-Stories-GGUF"  # the conftest's HF_HUB_CACHE
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, content in (("tiny-stories.Q8_0.gguf", stories.read_bytes()), ("mmproj-tiny-stories-f16.gguf", b"GGUF")):
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.write_bytes(content)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    assert "tiny-stories:q8_0" in {m["name"] for m in _json("list", "--json")}

    got = _by_name(_json("add", "--from", "hf", "--json"))
    assert set(got) == {"tiny-stories:q8_0"} and got["tiny-stories:q8_0"]["origin"] == \
        "someone/Tiny-Stories-GGUF/tiny-stories.Q8_0.gguf"
    entry = json.loads((isolated_home / "registry.json").read_text())["models"]["tiny-stories:q8_0"]
    assert entry["path"] == str(snap / "tiny-stories.Q8_0.gguf") and entry["mmproj"] == str(snap / "mmproj-tiny-stories-f16.gguf")
    names = [m["name"] for m in _json("list", "--json")]
    assert names.count("tiny-stories:q8_0") == 1
    assert {i["status"] for i in _json("add", "--from", "hf", "--json")["imported"]} == {"unchanged"}


def test_add_needs_a_file_or_a_source() -> None:
    res = run_cli("add")
    assert res.returncode == 2 and "--from" in res.stderr and res.stdout == ""
    res = run_cli("add", "--from", "ollama", "--name", "x")
    assert res.returncode == 2 and "--name" in res.stderr
