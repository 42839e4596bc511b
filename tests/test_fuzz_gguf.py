"""Structure-aware fuzzing of the GGUF header parser: valid files with one field changed, plus
byte flips and truncations. Every input parses or fails with BadModelFileError, fast and small."""

from __future__ import annotations

import signal
import struct
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localrun.errors import BadModelFileError
from localrun.gguf_header import GGUFMeta, parse_gguf_header, read_gguf

from . import reliability
from .conftest import STORIES, assets_or_skip

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# Values written over a field: edges of each width, and lengths far past any file (2^60 must not allocate).
BIG = [0, 1, 2, 3, 7, 8, 9, 12, 13, 31, 32, 33, 63, 64, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
       2**40, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@dataclass(frozen=True)
class Field:
    """One field of a GGUF header: where it is, how wide, and what it means."""

    kind: str  # version, n_tensors, n_kv, key_len, vtype, value, str_len, arr_type, arr_len, n_dims, dim, ttype, offset
    pos: int
    width: int  # 4 or 8 (little-endian unsigned); value fields may be 1, 2, 4 or 8


_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def fields_of(data: bytes) -> list[Field]:
    """Every field of a valid GGUF header, found by walking it (the parser under test is not used)."""
    out: list[Field] = []
    pos = 4

    def take(kind: str, width: int) -> int:
        nonlocal pos
        value = int.from_bytes(data[pos : pos + width], "little")
        out.append(Field(kind, pos, width))
        pos += width
        return value

    def string(kind: str) -> None:
        nonlocal pos
        n = take(kind, 8)
        pos += n

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == 8:
            string("str_len")
        elif vtype == 9:
            item = take("arr_type", 4)
            for _ in range(take("arr_len", 8)):
                value(item)
        else:
            take("value", _WIDTH[vtype])

    take("version", 4)
    n_tensors, n_kv = take("n_tensors", 8), take("n_kv", 8)
    for _ in range(n_kv):
        string("key_len")
        value(take("vtype", 4))
    for _ in range(n_tensors):
        string("str_len")
        for _ in range(take("n_dims", 4)):
            take("dim", 8)
        take("ttype", 4)
        take("offset", 8)
    return out


def built_gguf(path: Path) -> bytes:
    """A small but complete model header: a value of every type, arrays of numbers and strings,
    a custom alignment, and tensors of several types and ranks."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_name("fuzz")
    w.add_context_length(128)
    w.add_uint8("test.u8", 7)
    w.add_int8("test.i8", -7)
    w.add_uint16("test.u16", 700)
    w.add_int16("test.i16", -700)
    w.add_int32("test.i32", -70000)
    w.add_float32("test.f32", 0.5)
    w.add_bool("test.bool", True)
    w.add_uint64("test.u64", 2**40)
    w.add_int64("test.i64", -(2**40))
    w.add_float64("test.f64", 0.25)
    w.add_string("tokenizer.ggml.model", "gpt2")
    tokens = ["<s>", "</s>", "a", "b", "héllo", "ab", "", "x" * 40]
    w.add_token_list(tokens)
    w.add_token_types([1] * len(tokens))
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_array("general.tags", ["a", "b"])
    w.add_array("test.floats", [1.0, 2.0, 3.0])
    w.add_array("test.empty", [])
    w.add_tensor("token_embd.weight", np.ones((len(tokens), 32), np.float32))
    w.add_tensor("output_norm.weight", np.ones((32,), np.float16))
    w.add_tensor("blk.0.attn_q.weight", np.ones((2, 2, 2, 32), np.float32))
    w.add_tensor("blk.0.q8.weight", np.zeros((2, 34), np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@cache
def seeds() -> tuple[tuple[bytes, tuple[Field, ...]], ...]:
    """The valid files the mutations start from (each parses cleanly as a whole model)."""
    import tempfile

    out = []
    with tempfile.TemporaryDirectory() as d:
        blobs = [built_gguf(Path(d) / "built.gguf")]
    if STORIES.exists():
        blobs.append(STORIES.read_bytes())
    for blob in blobs:
        out.append((blob, tuple(fields_of(blob))))
    return tuple(out)


def test_seeds_are_valid_and_walked() -> None:
    """The fuzzing starts from files that parse, and the walker finds all their tensors."""
    assets_or_skip(STORIES)
    built, real = seeds()
    meta = parse_gguf_header(built[0], "built.gguf", len(built[0]))
    assert meta.metadata["general.alignment"] == 64 and len(meta.tensors) == 4
    assert meta.tensors[3].type_name == "Q8_0"
    assert sum(f.kind == "ttype" for f in built[1]) == 4
    assert sum(f.kind == "ttype" for f in real[1]) == len(read_gguf(STORIES).tensors)
    assert parse_gguf_header(real[0], "real.gguf", len(real[0])).vocab_size == 512


class Hang(Exception):
    pass


@contextmanager
def hang_guard(seconds: int = 20) -> Iterator[None]:
    """Turn an endless parse into a failure (a correct parse of these files takes milliseconds)."""

    def fire(signum: int, frame: object) -> None:
        raise Hang(f"the parser ran for {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def check(blob: bytes, size: int | None = None, whole_model: bool = True) -> GGUFMeta | None:
    """Parse; assert it either succeeds (and what callers read from it works) or fails cleanly,
    with a one-line message, in memory proportional to the input."""
    size = len(blob) if size is None else size
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    try:
        with hang_guard():
            meta = parse_gguf_header(blob, "fuzz.gguf", size, whole_model)
            meta.summary(), meta.parameters, meta.context_length, meta.quantization, meta.chat_template
    except BadModelFileError as e:
        # One printable line: names and values taken from the file cannot break it or reach a terminal.
        assert e.message and str(e).isprintable(), repr(str(e))
        assert "fuzz.gguf" in e.message
        meta = None
    peak = tracemalloc.get_traced_memory()[1] - before
    assert peak < 64 * len(blob) + (4 << 20), f"parsing a {len(blob)}-byte header allocated {peak} bytes"
    reliability.inputs("GGUF header")
    return meta


@pytest.fixture(scope="module", autouse=True)
def traced() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _pack(value: int, width: int) -> bytes:
    return (value % (1 << (8 * width))).to_bytes(width, "little")


@FUZZ
@given(data=st.data())
def test_one_field_changed(data: st.DataObject) -> None:
    """A valid file with one count, length, type tag, dimension, offset or value overwritten."""
    blob, fields = data.draw(st.sampled_from(seeds()), label="seed")
    kind = data.draw(st.sampled_from(sorted({f.kind for f in fields})), label="kind")
    f = data.draw(st.sampled_from([f for f in fields if f.kind == kind]), label="field")
    old = int.from_bytes(blob[f.pos : f.pos + f.width], "little")
    value = data.draw(st.one_of(
        st.sampled_from(BIG),
        st.integers(0, 16),  # type tags, dimension counts
        st.sampled_from([old - 1, old + 1, old * 2, old + 2**32]),
        st.integers(0, 2**64 - 1),
    ), label="value")
    b = bytearray(blob)
    b[f.pos : f.pos + f.width] = _pack(value, f.width)
    check(bytes(b), whole_model=data.draw(st.booleans(), label="whole_model"))


@FUZZ
@given(data=st.data())
def test_bytes_flipped_or_cut(data: st.DataObject) -> None:
    """Random bytes overwritten (inside a field or anywhere), bytes inserted or removed, and cuts."""
    blob, fields = data.draw(st.sampled_from(seeds()), label="seed")
    b = bytearray(blob)
    header_end = fields[-1].pos + fields[-1].width
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        pos = data.draw(st.integers(0, header_end - 1), label="pos")
        edit = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]), label="edit")
        if edit == "flip":
            b[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif edit == "set":
            b[pos : pos + 4] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
        elif edit == "insert":
            b[pos:pos] = data.draw(st.binary(min_size=1, max_size=9), label="bytes")
        else:
            del b[pos : pos + data.draw(st.integers(1, 9), label="n")]
    if data.draw(st.booleans(), label="cut"):
        b = b[: data.draw(st.integers(0, len(b)), label="at")]
    # The size the caller claims may be the blob's or larger (a header read over HTTP).
    size = len(b) + data.draw(st.sampled_from([0, 0, 1, 2**20, 2**62]), label="extra")
    check(bytes(b), size=size, whole_model=data.draw(st.booleans(), label="whole_model"))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000), flip=st.integers(0, 2000))
def test_files_on_disk(tmp_path: Path, cut: int, flip: int) -> None:
    """read_gguf on damaged files (short ones take the separate tiny-file path)."""
    blob = bytearray(seeds()[0][0])
    blob[flip % len(blob)] ^= 0xFF
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(bytes(blob[:cut]))
    try:
        with hang_guard():
            read_gguf(p)
    except BadModelFileError as e:
        assert str(e).isprintable() and "fuzz.gguf" in e.message
    reliability.inputs("GGUF header")


def test_huge_lengths_are_refused_before_reading() -> None:
    """Each length or count set to 2^60 in turn is refused (nothing of that size is allocated)."""
    blob, fields = seeds()[0]
    refused = 0
    for f in fields:
        if f.kind not in ("n_tensors", "n_kv", "key_len", "str_len", "arr_len", "dim") or f.width != 8:
            continue
        b = bytearray(blob)
        b[f.pos : f.pos + 8] = struct.pack("<Q", 2**60)
        assert check(bytes(b)) is None, f"a {f.kind} of 2^60 at byte {f.pos} was accepted"
        refused += 1
    assert refused > 40
