"""Fixtures of the converter tests (helpers live in convert_helpers.py)."""

from __future__ import annotations

import pytest
from convert_helpers import converter_cache, llama_cpp_converter_dir, make_checkpoint

import convert


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Build each architecture's tiny checkpoint once per session."""
    cache: dict[tuple, tuple] = {}

    def get(arch: str, **kw):  # noqa: ANN202
        key = (arch, repr(sorted(kw.items())))  # repr: a config= may hold dicts
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"ckpt-{arch}")
            model, tok = make_checkpoint(folder, arch, **kw)
            cache[key] = (folder, model, tok)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """convert.convert of a session checkpoint, once per architecture and options, for the tests
    that only read the file (the conversion is deterministic: a second one writes the same bytes)."""
    cache: dict[tuple, convert.Result] = {}

    def get(arch: str, **options):  # noqa: ANN202
        key = (arch, tuple(sorted(options.items())))
        if key not in cache:
            folder, _, _ = checkpoints(arch)
            out = tmp_path_factory.mktemp(f"converted-{arch}") / "m.gguf"
            cache[key] = convert.convert(folder, out, **options)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def llama_cpp_converter():  # noqa: ANN201
    """llama.cpp's convert_hf_to_gguf.py folder, from the llama-cpp-python sdist (cached)."""
    return llama_cpp_converter_dir(converter_cache())
