"""GGUF headers are validated before a file reaches llama.cpp."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from localrun.errors import BadModelFileError, LocalrunError
from localrun.gguf_header import read_gguf

from .ggufs import rewrite_gguf, without_byte_tokens


def test_reads_real_files(stories: Path, starter: Path) -> None:
    m = read_gguf(stories)
    assert (m.architecture, m.parameters, m.quantization, m.context_length, m.vocab_size) == (
        "llama", 292800, "F32", 2048, 512)
    s = read_gguf(starter)
    assert (s.architecture, s.quantization, s.context_length, s.vocab_size) == ("llama", "Q4_1", 8192, 49152)
    assert s.parameters == 134515008
    assert s.chat_template and "<|im_start|>" in s.chat_template
    assert s.metadata["tokenizer.ggml.pre"] == "smollm"


def test_the_vocabulary_decoded_when_asked_equals_gguf_pys(starter: Path) -> None:
    import gguf

    field = gguf.GGUFReader(starter).fields["tokenizer.ggml.tokens"]
    want = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    tokens = read_gguf(starter).metadata["tokenizer.ggml.tokens"]
    assert repr(tokens) == "StringArray(49152 strings)"  # not decoded yet
    assert len(tokens) == 49152 and tokens[0] == want[0] and tokens[-1] == want[-1] and tokens[1:3] == want[1:3]
    assert tokens == want and list(tokens) == want and "<|im_start|>" in tokens


def _bad(path: Path, match: str) -> None:
    with pytest.raises(BadModelFileError, match=match):
        read_gguf(path)


def test_missing_and_not_gguf(tmp_path: Path) -> None:
    _bad(tmp_path / "nope.gguf", "does not exist")
    text = tmp_path / "notes.gguf"
    text.write_text("hello, this is not a model at all")
    _bad(text, "not a GGUF file")
    st = tmp_path / "model.safetensors"
    st.write_bytes(struct.pack("<Q", 20) + b'{"a": 1}' + b" " * 40)
    with pytest.raises(BadModelFileError) as e:
        read_gguf(st)
    assert "safetensors" in str(e.value)
    zipped = tmp_path / "pytorch_model.bin"
    zipped.write_bytes(b"PK\x03\x04" + b"\0" * 60)
    with pytest.raises(BadModelFileError, match="zip"):
        read_gguf(zipped)
    _bad(tmp_path, "is a folder")


def test_truncated(stories: Path, tmp_path: Path) -> None:
    data = stories.read_bytes()
    for cut in (10, 100, 5000, len(data) // 2, len(data) - 1):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        _bad(p, "truncated|runs past the end")


def test_absurd_counts(stories: Path, tmp_path: Path) -> None:
    data = bytearray(stories.read_bytes())
    for offset in (8, 16):
        bad = bytearray(data)
        bad[offset : offset + 8] = struct.pack("<Q", 2**62)
        p = tmp_path / f"absurd{offset}.gguf"
        p.write_bytes(bad)
        _bad(p, "absurd counts")
    bad = bytearray(data)
    bad[4:8] = struct.pack("<I", 99)
    p = tmp_path / "version.gguf"
    p.write_bytes(bad)
    _bad(p, "version 99")


def test_missing_byte_tokens_are_caught(stories: Path, tmp_path: Path) -> None:
    p = without_byte_tokens(stories, tmp_path / "nobytes.gguf")
    _bad(p, "byte-fallback vocabulary without 256")


def test_out_of_range_special_token(stories: Path, tmp_path: Path) -> None:
    p = rewrite_gguf(stories, tmp_path / "eos.gguf",
                     lambda k, v: 70000 if k == "tokenizer.ggml.eos_token_id" else v)
    _bad(p, "eos_token_id = 70000")


def _mutants(data: bytes, header_end: int, n: int, seed: int) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            cut = rng.randrange(0, len(data))
            out.append((f"truncate@{cut}", data[:cut]))
            continue
        b = bytearray(data)
        if kind == 1:  # a few random bytes in the header
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(0, header_end)] = rng.randrange(256)
        elif kind == 2:  # a big number written over a length/count field somewhere in the header
            pos = rng.randrange(4, header_end - 8)
            b[pos : pos + 8] = struct.pack("<Q", rng.choice([2**63, 2**32 + 7, 0xFFFFFFFF, 10**12]))
        else:  # a run of garbage
            pos = rng.randrange(0, header_end)
            b[pos : pos + 16] = bytes(rng.randrange(256) for _ in range(16))
        out.append((f"mutant{i}", bytes(b)))
    return out


def test_fuzz_mutated_files_never_crash(stories: Path, tmp_path: Path) -> None:
    """Hundreds of damaged files: each is rejected with a clear error or, if it passes the header
    checks, runs in the isolated engine, where a native crash becomes an error too."""
    from localrun.backends.session import WorkerSession
    from localrun.generation import Request
    from localrun.settings import GenerationParams, LoadOptions
    from localrun.store import ModelInfo

    data = stories.read_bytes()
    header_end = len(data) - sum(t.n_bytes for t in read_gguf(stories).tensors)
    rejected, passed = 0, []
    for name, blob in _mutants(data, header_end, 400, seed=1234):
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        try:
            read_gguf(p)
        except BadModelFileError as e:
            assert str(p) in e.message or "GGUF" in e.message
            assert "\n" not in str(e)
            rejected += 1
            p.unlink()
            continue
        passed.append(p)
    assert rejected > 250, f"only {rejected} of 400 damaged files were rejected"
    outcomes = {"ok": 0, "error": 0}
    for p in passed[:25]:
        try:
            session = WorkerSession("llama.cpp", ModelInfo(p.stem, str(p), "gguf", "path", 0), LoadOptions(n_ctx=64))
            try:
                for _ in session.stream(Request.raw("Once upon a time 你好"), GenerationParams(temperature=0, max_tokens=4)):
                    pass
            finally:
                session.close()
            outcomes["ok"] += 1
        except LocalrunError as e:
            assert e.message
            outcomes["error"] += 1
    assert sum(outcomes.values()) == min(25, len(passed))
    assert outcomes["ok"] > 0, "no damaged file that passed the checks was run by the engine"
    print(f"rejected {rejected}, passed {len(passed)}, engine outcomes {outcomes}")
