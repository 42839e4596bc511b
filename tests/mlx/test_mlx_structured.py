"""Structured output on MLX with a real tokenizer: the SmolLM2 starter's trained weights exported
to Hugging Face layout, its tokenizer written the way transformers 5 writes it and the way 4.57
does (a SentencePiece-style decoder around the ByteLevel step, byte_fallback set, an empty
normalizer), each converted to MLX. The grammar engine must read both
tokenizers as the model does, and one that it reads differently is refused with the model's name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from localrun import api
from localrun.constraint import Constraint
from localrun.errors import BackendUnavailableError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import Store

from ..server.conftest import serve
from .conftest import collect, mlx_lm_convert

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
ASK = "Describe Paris"
WAYS = ("transformers-5", "transformers-4.57")


def as_transformers_457(folder: Path) -> None:
    """Rewrite an export's tokenizer.json as transformers 4.57 writes SmolLM2's (seen with 4.57.6),
    keeping what its users repair (no BOS, the digit split)."""
    path = folder / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    byte_level = tj["decoder"]
    assert byte_level["type"] == "ByteLevel"
    tj["normalizer"] = {"type": "Sequence", "normalizers": []}
    tj["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, byte_level]}
    tj["model"].update(byte_fallback=True, fuse_unk=True, unk_token="<|endoftext|>")
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")


@pytest.fixture(scope="module")
def ways(smol: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """way -> the starter as an MLX folder."""
    hf4 = tmp_path_factory.mktemp("smol-4.57") / "hf-4.57"
    shutil.copytree(smol["hf"], hf4)
    as_transformers_457(hf4)
    # mlx-lm's converter, which 'localrun convert --to mlx' runs: it saves the tokenizer through transformers
    out = {WAYS[0]: smol["mlx"], WAYS[1]: mlx_lm_convert(hf4, hf4.parent / "mlx-transformers-4.57")}
    # the 4.57 form survives the conversion: it is what the engine reads
    tj = json.loads((out["transformers-4.57"] / "tokenizer.json").read_text(encoding="utf-8"))
    assert tj["decoder"]["type"] == "Sequence" and tj["normalizer"] == {"type": "Sequence", "normalizers": []}
    return out


@pytest.fixture(scope="module")
def sessions(ways: dict[str, Path]) -> Iterator[dict[str, Any]]:
    opened = {way: api.load(Store(path.parent / ".store").get(str(path)), LoadOptions(n_ctx=512), engine="mlx")
              for way, path in ways.items()}
    yield opened
    for s in opened.values():
        s.close()


@pytest.mark.parametrize("way", WAYS)
def test_schema_replies_parse_greedy_and_sampled(sessions: dict[str, Any], way: str) -> None:
    grammar = Constraint.schema(SCHEMA).grammar
    request = api.build_messages(ASK)
    for temperature, seed in ((0.0, 0), (0.7, 2), (1.0, 3)):
        params = GenerationParams(temperature=temperature, seed=seed, max_tokens=60, grammar=grammar)
        text, last, _ = collect(sessions[way], request, params)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert last.finish_reason == "stop", (way, temperature, text)


def test_both_exports_answer_alike(sessions: dict[str, Any]) -> None:
    grammar = Constraint.schema(SCHEMA).grammar
    params = GenerationParams(temperature=0, max_tokens=60, grammar=grammar)
    texts = {way: collect(s, api.build_messages(ASK), params)[0] for way, s in sessions.items()}
    assert len(set(texts.values())) == 1, texts


@pytest.mark.parametrize("way", WAYS)
def test_server_response_format_validates(ways: dict[str, Path], way: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    name = api.add_model(ways[way], name="smol-mlx:135m").name  # in this test's own home
    with serve(LoadOptions(n_ctx=512, n_parallel=1)) as served:
        client = served.openai()
        for temperature, seed in ((0.0, 0), (0.8, 5)):
            reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": ASK}],
                                                   response_format=fmt, temperature=temperature, seed=seed,
                                                   max_tokens=60)
            jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
            assert reply.choices[0].finish_reason == "stop"


def test_grammar_engine_that_reads_the_tokenizer_differently_is_refused(ways: dict[str, Path], tmp_path: Path) -> None:
    """A vocabulary whose decoder the grammar engine reads one way and the model another (here a
    byte-level vocabulary given a SentencePiece decoder only): structured output is refused with
    the model's name and the first token that differs, before any token is generated; plain
    replies still run."""
    folder = tmp_path / "odd"
    shutil.copytree(ways["transformers-5"], folder)
    path = folder / "tokenizer.json"
    tj = json.loads(path.read_text(encoding="utf-8"))
    tj["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        {"type": "Replace", "pattern": {"String": "Paris"}, "content": "Rome"}]}
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    info = Store(folder.parent / ".store").get(str(folder))
    session = api.load(info, LoadOptions(n_ctx=512), engine="mlx")
    try:
        params = GenerationParams(temperature=0, max_tokens=20, grammar=Constraint.schema(SCHEMA).grammar)
        with pytest.raises(BackendUnavailableError, match=rf"structured output is not available for '{info.name}'.*"
                                                          r"grammar engine reads its tokenizer differently.*Paris"):
            collect(session, api.build_messages(ASK), params)
        text, last, _ = collect(session, Request.raw("The capital of France is"), GenerationParams(temperature=0, max_tokens=4))
        assert text and last.completion_tokens == 4
    finally:
        session.close()
