"""Real trained models for both engines, built once per test session from stories260K.gguf.

- plain: stories260K as GGUF (llama.cpp), as a Hugging Face checkpoint exported by transformers
  (the PyTorch reference) and as an MLX folder made by mlx-lm's converter from that checkpoint.
- chat: the same weights with a chat template and "." as the end-of-sequence token, so chat
  replies end with finish_reason "stop" after a sentence.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.generation import Chunk, Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import Store

from ..conftest import STORIES, assets_or_skip
from ..ggufs import rewrite_gguf

ENGINES = ("llama.cpp", "mlx")
# Plain-text roles. No BOS in the template: after a BOS written as text, llama.cpp and Hugging Face
# tokenizers disagree on SentencePiece's leading space (test_mlx_backend checks the MLX side).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
N_CTX = 1024


@dataclass(frozen=True)
class Variant:
    gguf: Path
    hf: Path
    mlx: Path
    eos: int

    def path(self, engine: str) -> Path:
        return self.gguf if engine == "llama.cpp" else self.mlx


@dataclass(frozen=True)
class Models:
    plain: Variant
    chat: Variant


def copy_gguf(src: Path, dst: Path, edit: dict[str, Any], chat_template: str | None = None) -> Path:
    """Copy a GGUF with metadata values replaced (None drops the key) and an optional chat template."""
    import gguf

    add = {"tokenizer.chat_template": (chat_template, gguf.GGUFValueType.STRING)} if chat_template is not None else {}
    return rewrite_gguf(src, dst, lambda key, value: edit.get(key, value), add)


def export_hf(gguf_path: Path, dst: Path) -> Path:
    """transformers' GGUF loader -> save_pretrained: config.json, model.safetensors, tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model.hf_quantizer = None  # dequantized on load; lets save_pretrained write plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(dst))
    tokenizer.save_pretrained(str(dst))
    return dst


def mlx_lm_convert(hf: Path, dst: Path, **kwargs: Any) -> Path:
    from mlx_lm.convert import convert

    convert(str(hf), str(dst), **kwargs)
    return dst


def set_template_and_eos(folder: Path, template: str, eos_token: str, eos_id: int) -> None:
    """Give a Hugging Face / MLX folder a chat template and another end-of-sequence token."""
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.update(chat_template=template, eos_token=eos_token)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((folder / name).read_text())
        cfg["eos_token_id"] = eos_id
        (folder / name).write_text(json.dumps(cfg))


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    src = assets_or_skip(STORIES)
    root = tmp_path_factory.mktemp("mlx-models")
    # transformers cannot read the GGUF's "no padding token" (0xFFFFFFFF); llama.cpp ignores it.
    plain_gguf = copy_gguf(src, root / "stories.gguf", {"tokenizer.ggml.padding_token_id": None})
    plain_hf = export_hf(plain_gguf, root / "stories-hf")
    plain_mlx = mlx_lm_convert(plain_hf, root / "stories-mlx")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(plain_hf))
    dot = tok.convert_tokens_to_ids(".")
    chat_gguf = copy_gguf(plain_gguf, root / "stories-chat.gguf", {"tokenizer.ggml.eos_token_id": dot},
                          chat_template=TEMPLATE)
    chat_hf = root / "stories-chat-hf"
    shutil.copytree(plain_hf, chat_hf)
    set_template_and_eos(chat_hf, TEMPLATE, ".", dot)
    chat_mlx = root / "stories-chat-mlx"
    shutil.copytree(plain_mlx, chat_mlx)
    set_template_and_eos(chat_mlx, TEMPLATE, ".", dot)
    return Models(Variant(plain_gguf, plain_hf, plain_mlx, int(tok.eos_token_id)), Variant(chat_gguf, chat_hf, chat_mlx, dot))


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The SmolLM2 starter's trained weights exported to Hugging Face layout by transformers ("hf")
    and converted by mlx-lm's converter, which 'localrun convert --to mlx' runs ("mlx")."""
    from ..conftest import starter_or_fail

    root = tmp_path_factory.mktemp("smol")
    hf = export_hf(starter_or_fail(), root / "hf")
    return {"hf": hf, "mlx": mlx_lm_convert(hf, root / "smol-mlx")}


def load(path: Path, engine: str | None = None, n_ctx: int = N_CTX) -> Any:
    """A worker session for a model path (the store lookup is kept out of the user's data dir)."""
    info = Store(path.parent / ".store").get(str(path))
    return api.load(info, LoadOptions(n_ctx=n_ctx), engine=engine)


@pytest.fixture(scope="session")
def sessions(models: Models) -> Iterator[Callable[[str, str], Any]]:
    """open(engine, "plain" | "chat") -> a loaded worker session, shared by the whole folder."""
    opened: dict[tuple[str, str], Any] = {}

    def open_session(engine: str, variant: str) -> Any:
        if (engine, variant) not in opened:
            opened[engine, variant] = load(getattr(models, variant).path(engine), engine)
        return opened[engine, variant]

    yield open_session
    for s in opened.values():
        s.close()


def collect(session: Any, request: Request, params: GenerationParams, cancel: Any = None) -> tuple[str, Chunk, int]:
    """(text, final chunk, number of text chunks) of one streamed reply."""
    parts: list[str] = []
    last = None
    for chunk in api.stream(session, request, params, cancel):
        assert last is None, "nothing may follow the final chunk"
        if chunk.done:
            last = chunk
        else:
            assert chunk.text, "text chunks are never empty"
            parts.append(chunk.text)
    assert last is not None
    return "".join(parts), last, len(parts)


def torch_greedy(hf: Path, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """The PyTorch (transformers) reference: greedy new token ids, stopping before eos."""
    import torch

    model = _torch_model(str(hf))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    return new[: new.index(eos)] if eos in new else new


_TORCH_MODELS: dict[str, Any] = {}


def _torch_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    if path not in _TORCH_MODELS:
        _TORCH_MODELS[path] = AutoModelForCausalLM.from_pretrained(path).eval()
    return _TORCH_MODELS[path]
