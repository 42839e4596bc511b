"""Build GGUF variants of a real file for tests (rewritten metadata, same tensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def rewrite_gguf(
    src: Path,
    dst: Path,
    edit: Callable[[str, Any], Any] | None = None,
    add: dict[str, tuple[Any, Any]] | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """Copy a GGUF, passing each metadata value through edit(key, value) (None drops the key)
    and adding `add` keys as {key: (value, GGUFValueType)}; tensors are copied unchanged.
    With split_max_tensors the copy is split like llama.cpp's gguf-split (dst names the set)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch, split_max_tensors=split_max_tensors)
    add = add or {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in add:
            continue
        value = edit(key, field.contents()) if edit else field.contents()
        if value is None:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, list(value), vtype, sub_type=sub)
        else:
            writer.add_key_value(key, value, vtype)
    for key, (value, vtype) in add.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        data = np.array(t.data)  # a quantized tensor's rows as bytes: its shape is the byte shape the writer takes
        writer.add_tensor(t.name, data, raw_shape=list(data.shape), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def without_byte_tokens(src: Path, dst: Path) -> Path:
    """A SentencePiece vocabulary whose <0xNN> byte-fallback tokens were renamed away."""

    def edit(key: str, value: Any) -> Any:
        if key == "tokenizer.ggml.tokens":
            return [f"<unused{i}>" if t.startswith("<0x") else t for i, t in enumerate(value)]
        return value

    return rewrite_gguf(src, dst, edit)


def dequantize_to_f16(src: Path, dst: Path) -> Path:
    """An F16 GGUF of a quantized one (1-D tensors stay F32): a 16-bit reference whose weights
    are exactly the quantized model's, for quantization tests on a real trained model."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_uint32(key, int(gguf.LlamaFileType.MOSTLY_F16))
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, values.astype(np.float16) if values.ndim > 1 else values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
