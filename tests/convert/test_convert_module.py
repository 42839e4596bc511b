"""convert.from_module: an in-memory transformers model gives the same file as its saved folder."""

from __future__ import annotations

from pathlib import Path

from convert_helpers import gguf_reader

import convert


def test_from_module_matches_folder_conversion(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, model, tok = checkpoints("llama")
    a = convert.from_module(model, tok, tmp_path / "mem.gguf", outtype="q8_0").path
    b = convert.convert(folder, tmp_path / "disk.gguf", outtype="q8_0").path
    ra, rb = gguf_reader(a), gguf_reader(b)  # slow on a 151k vocabulary: read each once
    ta = {t.name: (t.tensor_type, bytes(t.data)) for t in ra.tensors}
    tb = {t.name: (t.tensor_type, bytes(t.data)) for t in rb.tensors}
    assert ta == tb
    for key in ("tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "llama.block_count"):
        assert ra.fields[key].contents() == rb.fields[key].contents()
