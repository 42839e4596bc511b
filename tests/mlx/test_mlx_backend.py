"""What only the MLX engine has: its loading errors, template sandbox, BOS handling and probes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from localrun.backends.base import RowResult
from localrun.errors import BadModelFileError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import Store

from .conftest import Models, collect, load


@pytest.fixture(scope="module")
def bos_template_model(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bos") / "stories-bos-mlx"
    shutil.copytree(models.chat.mlx, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="module")
def in_process(bos_template_model: Path) -> Iterator[Any]:
    """An MLX session in this process, to look at its tokenization directly."""
    from localrun.backends.loop import InProcess
    from localrun.backends.mlx import MLXBackend

    session = InProcess(MLXBackend().load(Store(bos_template_model.parent / ".store").get(str(bos_template_model)),
                                          LoadOptions(n_ctx=256)))
    yield session
    session.close()


def test_template_that_writes_the_bos_gets_no_second_one(models: Models, in_process: Any) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.plain.hf))
    ids = in_process.tokenize(Request.chat([{"role": "user", "content": "Hi there"}]))
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids == list(tok.encode("<s>Hi there\n", add_special_tokens=False))


def test_raw_prompt_special_token_text_is_not_parsed(in_process: Any) -> None:
    """Like llama.cpp, a raw prompt's '<s>' is text, not a control token (the chat template's is)."""
    ids = in_process.tokenize(Request.raw("Hello <s> there"))
    assert ids.count(1) == 1 and ids[0] == 1


def test_in_process_cancel_before_the_first_token(in_process: Any) -> None:
    class Set:
        def is_set(self) -> bool:
            return True

    chunks = list(in_process.stream(Request.raw("Once upon a time"), GenerationParams(temperature=0), Set()))
    assert len(chunks) == 1 and chunks[0].finish_reason == "cancelled" and chunks[0].completion_tokens == 0
    again = list(in_process.stream(Request.raw("Once upon a time"), GenerationParams(temperature=0, max_tokens=5)))
    assert again[-1].completion_tokens == 5 and "".join(c.text for c in again).startswith(",")


def test_chat_template_runs_in_the_sandbox(models: Models, tmp_path: Path) -> None:
    folder = tmp_path / "evil-mlx"
    shutil.copytree(models.plain.mlx, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    session = load(folder, "mlx")
    try:
        with pytest.raises(BadModelFileError, match="unsafe operation"):
            collect(session, Request.chat([{"role": "user", "content": "hi"}]), GenerationParams(max_tokens=2))
        text, last, _ = collect(session, Request.raw("Once"), GenerationParams(temperature=0, max_tokens=3))
        assert last.completion_tokens == 3 and text
    finally:
        session.close()


@pytest.mark.parametrize(("edit", "match"), [
    ({"model_type": "no_such_arch", "architectures": ["NoSuchArch"]}, "no_such_arch"),
    (None, "No safetensors"),
])
def test_unloadable_folders_are_errors_that_name_the_model(models: Models, tmp_path: Path, edit: Any,
                                                            match: str) -> None:
    folder = tmp_path / "broken-mlx"
    shutil.copytree(models.plain.mlx, folder)
    if edit is None:
        for f in folder.glob("*.safetensors"):
            f.unlink()
    else:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(BadModelFileError, match=match) as e:
        load(folder, "mlx")
    assert "broken-mlx" in e.value.message and e.value.hint


def test_system_info_names_versions_and_device() -> None:
    from importlib.metadata import version

    from localrun.backends.mlx import system_info

    info = system_info()
    assert info["mlx"] == version("mlx") and info["mlx_lm"] == version("mlx-lm")
    assert info["device"].startswith("Metal GPU" if sys.platform == "darwin" else ("CPU", "CUDA GPU"))


def test_probing_and_choosing_mlx_imports_no_mlx(models: Models) -> None:
    code = (
        "import sys\nfrom localrun import api\nfrom localrun.store import Store\n"
        f"info = Store(__import__('pathlib').Path({str(models.plain.mlx)!r}).parent / '.s').get({str(models.plain.mlx)!r})\n"
        "assert api.choose_engine(info) == 'mlx'\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'torch', 'transformers'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_batch_through_mlx_lm_equals_one_by_one(models: Models) -> None:
    """mlx-lm's continuous batching under the engine loop: greedy text as sequential."""
    prompts = ["Once upon a time", "Lily and Tom went to the park", "The little dog"]
    session = load(models.plain.mlx, "mlx")
    try:
        params = GenerationParams(temperature=0, max_tokens=30)
        one_by_one = [collect(session, Request.raw(p), params)[0] for p in prompts]
        out = _many(session, prompts, params)
        assert [r["text"] for r in out] == one_by_one
        assert all(r["finish_reason"] == "length" and r["completion_tokens"] == 30 for r in out)
        stop = "park"
        stopped = _many(session, prompts, GenerationParams(temperature=0, max_tokens=30, stop=(stop,)))
        for r, full in zip(stopped, one_by_one, strict=True):
            if stop in full:
                assert r["text"] == full[: full.index(stop)] and r["finish_reason"] == "stop"
            else:
                assert r["text"] == full and r["finish_reason"] == "length"
        assert any(r["finish_reason"] == "stop" for r in stopped)
    finally:
        session.close()


def _many(session: Any, prompts: list[str], params: GenerationParams) -> list[dict[str, Any]]:
    """Results of the engine loop's batch path, in prompt order."""
    rows = {e.id: asdict(e) for e in session.generate_many([(i, Request.raw(p), params) for i, p in enumerate(prompts)])
            if isinstance(e, RowResult)}
    return [rows[i] for i in range(len(prompts))]


@pytest.mark.parametrize("kind", ["qwen3", "llama2-spm"])
def test_logprob_pieces_are_each_tokens_bytes_in_the_reply(kind: str) -> None:
    """A reply's tokens' logprob bytes make its text, as llama.cpp's pieces do: a SentencePiece
    word's leading space kept (llama2-spm has no tokenizer.json: mlx-lm decodes it naively), a
    character split across byte tokens kept whole in the bytes (decoding each token alone gives
    U+FFFD and no space)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from localrun.backends.mlx_text import token_pieces
    from tests.conftest import ASSETS, assets_or_skip

    tokenizer = load_tokenizer(assets_or_skip(ASSETS / "tokenizers" / kind))
    text = "Hello wörld, 🙂 and 漢字 ok"
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    pieces = token_pieces(tokenizer)
    got = b"".join(pieces(t) for t in ids)
    assert got == (" " + text if kind == "llama2-spm" else text).encode()  # SentencePiece's word-start space
    assert any(pieces(t) and not _is_utf8(pieces(t)) for t in ids)  # a character split across tokens


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True
