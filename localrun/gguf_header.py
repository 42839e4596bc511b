"""Reading and validating GGUF model files before they reach an engine.

gguf-py's GGUFReader builds a numpy view for every array element (about 4 s on the starter
model's 100k vocabulary entries), so the header is parsed here with strict bounds checks; gguf-py
supplies the format's constants (value types, quantization block sizes, file types).
"""

from __future__ import annotations

import functools
import importlib.util
import mmap
import os
import re
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from localrun.errors import BadModelFileError

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME
# Arrays whose items are kept (others are skipped and only counted).
KEPT_ARRAYS = {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "general.languages", "general.tags"}
# String arrays kept as their bytes and decoded on first use: a 152k-token vocabulary takes 0.2 s
# to decode, which every `run` would pay before its model starts loading.
LAZY_ARRAYS = {"tokenizer.ggml.tokens"}

# The tensors of a mixture-of-experts layer's experts: llama.cpp's LLM_FFN_EXPS_REGEX, the pattern its
# --cpu-moe override matches (with std::regex_search, as re.search does here).
EXPERT_TENSORS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
_EXPERT_TENSOR = re.compile(r"^blk\.(\d+)" + EXPERT_TENSORS)

# GGUFValueType -> struct format for scalar types.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    n_elements: int
    n_bytes: int
    offset: int


@dataclass(frozen=True)
class GGUFMeta:
    """What localrun needs to know about a GGUF file, read from its header."""

    path: str
    version: int
    size: int
    metadata: dict[str, Any] = field(repr=False)
    array_lengths: dict[str, int] = field(repr=False)
    tensors: tuple[TensorInfo, ...] = field(repr=False)

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None

    def arch_value(self, key: str) -> Any:
        """The value of `{architecture}.{key}`, or None."""
        return self.metadata.get(f"{self.architecture}.{key}")

    @property
    def parameters(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def context_length(self) -> int | None:
        value = self.arch_value("context_length")
        return int(value) if isinstance(value, int) else None

    @property
    def quantization(self) -> str | None:
        return quantization_name(self)

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int:
        return self.array_lengths.get("tokenizer.ggml.tokens", 0)

    def summary(self) -> dict[str, Any]:
        """The metadata `show` prints: everything but the big arrays, plus derived facts."""
        meta = {k: v for k, v in self.metadata.items() if k not in KEPT_ARRAYS or k.startswith("general.")}
        for key, n in self.array_lengths.items():
            if key not in meta:
                meta[key] = f"[{n} items]"
        return meta


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's experts, from its GGUF header(s)."""

    count: int  # experts in each MoE layer ({arch}.expert_count)
    used: int  # experts each token goes through ({arch}.expert_used_count)
    shared: int  # shared experts every token goes through ({arch}.expert_shared_count; 0: none)
    layers: int  # the model's layers ({arch}.block_count)
    active_parameters: int  # what one token goes through: `used` of `count` experts, all the rest
    layer_bytes: dict[int, int] = field(repr=False)  # the expert tensors' bytes per layer
    complete: bool = True  # every part's header was read (False: only the first part's of a split file)

    @property
    def expert_bytes(self) -> int:
        return sum(self.layer_bytes.values())

    def cpu_layers(self, cpu_moe: int | str) -> int:
        """How many layers' experts --cpu-moe N (or 'all') keeps in host memory."""
        return self.layers if cpu_moe == "all" else min(int(cpu_moe), self.layers)

    def host_bytes(self, cpu_moe: int | str) -> int:
        """The expert bytes of the layers --cpu-moe keeps in host memory. A layer without expert
        tensors is a dense one (0 bytes), unless the header was incomplete and the layer comes after
        every layer it listed (a later part of a split file): that counts as the mean of those listed."""
        n = self.cpu_layers(cpu_moe)
        if n <= 0 or not self.layer_bytes:
            return 0
        last = max(self.layer_bytes)
        unread = 0 if self.complete else self.expert_bytes // len(self.layer_bytes)
        return sum(self.layer_bytes.get(i, unread if i > last else 0) for i in range(n))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (a model's details["experts"] in the store); from_dict reads it back."""
        return {"count": self.count, "used": self.used, "shared": self.shared, "layers": self.layers,
                "active_parameters": self.active_parameters,
                "layer_bytes": {str(k): v for k, v in self.layer_bytes.items()}, "complete": self.complete}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Experts:
        return cls(int(d["count"]), int(d["used"]), int(d["shared"]), int(d["layers"]), int(d["active_parameters"]),
                   {int(k): int(v) for k, v in d["layer_bytes"].items()}, bool(d.get("complete", True)))


def model_experts(details: dict[str, Any]) -> Experts | None:
    """The experts an installed model's details hold (the store reads them from every part), or None."""
    d = details.get("experts")
    return Experts.from_dict(d) if isinstance(d, dict) else None


def experts_of(metas: list[GGUFMeta], complete: bool = True) -> Experts | None:
    """The experts of a mixture-of-experts model (its GGUF parts, first part first), or None.

    complete=False: metas are not every part (the first part's header of a split file)."""
    first = metas[0]

    def num(key: str) -> int:
        value = first.arch_value(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else 0

    count = num("expert_count")
    layer_bytes: dict[int, int] = {}
    active = 0
    used = min(num("expert_used_count") or count, count)
    for t in (t for m in metas for t in m.tensors):
        match = _EXPERT_TENSOR.search(t.name)
        if match and count > 0:
            layer = int(match.group(1))
            layer_bytes[layer] = layer_bytes.get(layer, 0) + t.n_bytes
            active += t.n_elements * used // count
        else:
            active += t.n_elements
    if count <= 0 or not layer_bytes:
        return None
    return Experts(count, used, num("expert_shared_count"), num("block_count") or max(layer_bytes) + 1,
                   active, layer_bytes, complete)


def _safe(text: str) -> str:
    """Text from the file as quoted in an error: control characters escaped, so it stays one line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@functools.cache
def gguf_constants() -> Any:
    """gguf-py's constants module (enums and block sizes; it imports only the standard library).

    Importing `gguf.constants` runs the package's __init__, which imports numpy, its reader and
    its writer: 0.12 s that `localrun run` would pay before its model starts loading. So, unless
    gguf is already imported, the module's file is loaded on its own, under a private name; only
    names and sizes are read from it here (never gguf's enum classes handed out)."""
    if "gguf.constants" in sys.modules:
        return sys.modules["gguf.constants"]
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the gguf package is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "constants.py"
    own = importlib.util.spec_from_file_location("localrun._gguf_constants", path)
    assert own is not None and own.loader is not None
    module = importlib.util.module_from_spec(own)
    own.loader.exec_module(module)
    return module


class StringArray(Sequence[str]):
    """A GGUF string array, bounds-checked when read, decoded when first used."""

    def __init__(self, raw: bytes, count: int) -> None:
        self._raw: bytes | None = raw
        self._count = count
        self._items: list[str] = []

    def _decoded(self) -> list[str]:
        if self._raw is not None:
            raw, unpack, pos, out = self._raw, struct.unpack_from, 0, []
            for _ in range(self._count):
                n = unpack("<Q", raw, pos)[0]
                out.append(raw[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            self._items, self._raw = out, None
        return self._items

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...
    def __getitem__(self, i: int | slice) -> str | list[str]:
        return self._decoded()[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringArray):
            return self._decoded() == other._decoded()
        return isinstance(other, (list, tuple)) and self._decoded() == list(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-list semantics, as the list it stands for

    def __repr__(self) -> str:
        return f"StringArray({self._count} strings)"


class _Cursor:
    """A bounds-checked reader over the file's bytes."""

    def __init__(self, buf: bytes | mmap.mmap, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def fail(self, what: str) -> BadModelFileError:
        return BadModelFileError(
            f"'{self.path}' is not a valid GGUF file: {_safe(what)} (at byte {self.pos})",
            "the file may be truncated or corrupted; download or convert it again",
        )

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(f"{what} runs past the end of the file")

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_strings(self, count: int, what: str) -> None:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"{what} runs past the end of the file")
            pos += 8 + unpack("<Q", buf, pos)[0]
        if pos > end:
            raise self.fail(f"{what} runs past the end of the file")
        self.pos = pos

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.unpack_from
        out = []
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"{what} runs past the end of the file")
            n = unpack("<Q", buf, pos)[0]
            pos += 8
            if pos + n > end:
                self.pos = pos
                raise self.fail(f"{what} runs past the end of the file")
            out.append(bytes(buf[pos : pos + n]).decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def _describe_non_gguf(head: bytes) -> str:
    if head[:2] == b"PK":
        return "it looks like a zip archive (a PyTorch .bin?); convert it with 'localrun convert'"
    if len(head) >= 9 and head[8:9] == b"{":
        return "it looks like a safetensors file; convert its folder with 'localrun convert'"
    if head[:1] == b"\x80":
        return "it looks like a Python pickle; convert its folder with 'localrun convert'"
    return "pass a .gguf model file, or a model name from 'localrun list'"


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> tuple[Any, int | None]:
    """Read one value; arrays return (items or None, length)."""
    if vtype in _SCALAR:
        return cur.unpack(_SCALAR[vtype], f"value of '{key}'"), None
    if vtype == _STRING:
        return cur.string(f"value of '{key}'"), None
    if vtype != _ARRAY or depth > 0:
        raise cur.fail(f"key '{key}' has unknown value type {vtype}")
    item_type = cur.unpack("<I", f"array type of '{key}'")
    count = cur.unpack("<Q", f"array length of '{key}'")
    keep = key in KEPT_ARRAYS
    if item_type in _SCALAR:
        fmt = _SCALAR[item_type]
        size = struct.calcsize(fmt)
        cur.need(count * size, f"array '{key}' ({count} items)")
        items = None
        if keep:
            items = list(struct.unpack_from(f"<{count}{fmt[1]}", cur.buf, cur.pos))
        cur.pos += count * size
        return items, count
    if item_type == _STRING:
        cur.need(count * 8, f"array '{key}' ({count} items)")
        if key in LAZY_ARRAYS:
            start = cur.pos
            cur.skip_strings(count, f"array '{key}'")
            return StringArray(bytes(cur.buf[start : cur.pos]), count), count
        if keep:
            return cur.strings(count, f"array '{key}'"), count
        cur.skip_strings(count, f"array '{key}'")
        return None, count
    if item_type == _ARRAY:
        cur.need(count * 12, f"array '{key}' ({count} items)")
        for _ in range(count):
            _read_value(cur, _ARRAY, key, depth + 1)
        return None, count
    raise cur.fail(f"array '{key}' has unknown item type {item_type}")


def read_gguf(path: str | os.PathLike[str], whole_model: bool = True) -> GGUFMeta:
    """Parse and validate a GGUF file's header without loading its tensors.

    whole_model=False is for the later parts of a split GGUF, which hold tensors but no model keys.

    Raises BadModelFileError naming the file and the problem.
    """
    p = Path(path)
    shown = str(path)
    if not p.exists():
        raise BadModelFileError(f"model file '{shown}' does not exist", "check the path")
    if p.is_dir():
        raise BadModelFileError(f"'{shown}' is a folder, not a GGUF file", "pass the .gguf file inside it")
    try:
        size = p.stat().st_size
        with open(p, "rb") as f:
            if size < 24:
                head = f.read(24)
                if head[:4] == GGUF_MAGIC:
                    raise BadModelFileError(f"'{shown}' is truncated ({size} bytes)", "download or convert it again")
                raise BadModelFileError(f"'{shown}' is not a GGUF file", _describe_non_gguf(head))
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return parse_gguf_header(buf, shown, size, whole_model)
    except OSError as e:
        raise BadModelFileError(f"cannot read model file '{shown}': {e.strerror or e}", "check its permissions") from e


def parse_gguf_header(buf: bytes | mmap.mmap, shown: str, size: int, whole_model: bool = True) -> GGUFMeta:
    """Parse and validate a GGUF header held in `buf` (the whole file, or its first bytes when
    `size` says how long the whole file is, as for a header read over HTTP)."""
    constants = gguf_constants()
    GGML_QUANT_SIZES, GGMLQuantizationType = constants.GGML_QUANT_SIZES, constants.GGMLQuantizationType  # noqa: N806

    if buf[:4] != GGUF_MAGIC:
        raise BadModelFileError(f"'{shown}' is not a GGUF file", _describe_non_gguf(bytes(buf[:16])))
    cur = _Cursor(buf, shown)
    cur.pos = 4
    version = cur.unpack("<I", "version")
    if version not in (2, 3):
        raise BadModelFileError(
            f"'{shown}' has GGUF version {version}, which is not supported (2 and 3 are)",
            "convert the model again with a current converter",
        )
    n_tensors = cur.unpack("<Q", "tensor count")
    n_kv = cur.unpack("<Q", "metadata count")
    # Each key/value takes at least 13 bytes and each tensor entry at least 29: absurd counts
    # are rejected before any allocation.
    if n_kv * 13 > size or n_tensors * 29 > size:
        raise cur.fail(f"absurd counts ({n_kv} metadata keys, {n_tensors} tensors for a {size}-byte file)")
    metadata: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        vtype = cur.unpack("<I", f"type of '{key}'")
        value, length = _read_value(cur, vtype, key)
        if key in metadata or key in lengths:
            raise cur.fail(f"metadata key '{key}' appears twice")
        if length is not None:
            lengths[key] = length
            if value is not None:
                metadata[key] = value
        else:
            metadata[key] = value
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}, not a power of two")

    infos = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = cur.string("tensor name")
        if len(name.encode()) >= MAX_NAME or name in names:
            raise cur.fail(f"tensor name '{name[:80]}' is too long or repeated")
        names.add(name)
        n_dims = cur.unpack("<I", f"dimensions of '{name}'")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dimensions")
        shape = tuple(cur.unpack("<Q", f"shape of '{name}'") for _ in range(n_dims))
        ttype = cur.unpack("<I", f"type of '{name}'")
        offset = cur.unpack("<Q", f"offset of '{name}'")
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor '{name}' has unknown type {ttype}") from None
        n_elements = 1
        for d in shape:
            if d == 0 or d > size * 8:
                raise cur.fail(f"tensor '{name}' has impossible shape {shape}")
            n_elements *= d
        if shape[0] % block:
            raise cur.fail(f"tensor '{name}' row of {shape[0]} is not a multiple of {qtype.name}'s block {block}")
        n_bytes = n_elements // block * type_size
        if offset % alignment:
            raise cur.fail(f"tensor '{name}' offset {offset} is not aligned to {alignment}")
        infos.append(TensorInfo(name, shape, qtype.name, n_elements, n_bytes, offset))
    data_start = -(-cur.pos // alignment) * alignment
    for t in infos:
        if data_start + t.offset + t.n_bytes > size:
            raise BadModelFileError(
                f"'{shown}' is truncated: tensor '{_safe(t.name)}' ends at byte {data_start + t.offset + t.n_bytes}"
                f" but the file has {size}",
                "download or convert it again",
            )
    meta = GGUFMeta(shown, version, size, metadata, lengths, tuple(infos))
    if whole_model:
        _check_model(meta)
    return meta


def _check_model(meta: GGUFMeta) -> None:
    """Semantic checks for things that make llama.cpp abort instead of failing cleanly."""
    shown = meta.path
    if not meta.architecture:
        raise BadModelFileError(f"'{shown}' has no general.architecture key", "convert the model again")
    if not meta.tensors:
        raise BadModelFileError(
            f"'{shown}' holds no tensors (a vocabulary-only file?)", "pass a complete model file"
        )
    if meta.metadata.get("general.type") == "adapter":
        _check_adapter(meta)
        return
    n_vocab = meta.vocab_size
    if n_vocab == 0:
        raise BadModelFileError(f"'{shown}' has no vocabulary (tokenizer.ggml.tokens)", "convert the model again")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in meta.array_lengths and meta.array_lengths[key] != n_vocab:
            raise BadModelFileError(
                f"'{shown}' has {meta.array_lengths[key]} entries in {key} for {n_vocab} tokens",
                "convert the model again",
            )
    for key, value in meta.metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and isinstance(value, int):
            if not 0 <= value < n_vocab and value != 0xFFFFFFFF:
                raise BadModelFileError(
                    f"'{shown}' sets {_safe(key)} = {value}, outside its vocabulary of {n_vocab}",
                    "convert the model again",
                )
    if meta.metadata.get("tokenizer.ggml.model") == "llama":
        # SentencePiece vocabularies fall back to <0xNN> tokens; llama.cpp aborts the process
        # (std::out_of_range) when one is missing and a prompt needs it.
        tokens = set(meta.metadata.get("tokenizer.ggml.tokens", ()))
        missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in tokens]
        if missing:
            raise BadModelFileError(
                f"'{shown}' has a byte-fallback vocabulary without {len(missing)} of its 256 byte tokens"
                f" (e.g. {missing[0]}); llama.cpp would crash on text that needs them",
                "convert the model again with 'localrun convert'",
            )


def _check_adapter(meta: GGUFMeta) -> None:
    """A LoRA adapter holds lora_a/lora_b pairs and no vocabulary (it runs on its base model's)."""
    shown = meta.path
    kind = meta.metadata.get("adapter.type")
    if kind != "lora":
        raise BadModelFileError(f"'{shown}' is a {_safe(str(kind or 'untyped'))} adapter; localrun runs LoRA adapters",
                                "convert the PEFT adapter folder with 'localrun convert ADAPTER_DIR'")
    names = {t.name for t in meta.tensors}
    unpaired = sorted(n for n in names if n.endswith((".lora_a", ".lora_b"))
                      and (n[:-1] + ("b" if n.endswith("a") else "a")) not in names)
    if unpaired:
        raise BadModelFileError(f"'{shown}' has an unpaired LoRA tensor '{_safe(unpaired[0])}'",
                                "convert the adapter again with 'localrun convert ADAPTER_DIR'")


def quantization_name(meta: GGUFMeta) -> str | None:
    """The file type (e.g. Q4_K_M), from general.file_type or the commonest tensor type."""
    LlamaFileType = gguf_constants().LlamaFileType  # noqa: N806
    ft = meta.metadata.get("general.file_type")
    if isinstance(ft, int):
        try:
            name = LlamaFileType(ft).name
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            pass
    counts: dict[str, int] = {}
    for t in meta.tensors:
        if len(t.shape) >= 2:
            counts[t.type_name] = counts.get(t.type_name, 0) + t.n_elements
    return max(counts, key=lambda k: counts[k]) if counts else None
