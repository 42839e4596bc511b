"""Converted GGUF files compute what the PyTorch model computes (llama.cpp vs transformers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from convert_helpers import (
    AGREEMENT,
    ARCHS,
    LAYER_SHARE,
    assert_logits_close,
    break_last_layer,
    llama_probe,
    logit_ids,
    make_checkpoint,
    reference_logits,
    save_layered,
    top1_agreement,
)

import convert


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(arch: str, checkpoints, converted) -> None:  # noqa: ANN001
    _, model, tok = checkpoints(arch)
    out = converted(arch, outtype="f32", name="tiny").path
    ids = logit_ids(tok)
    ref = reference_logits(model, ids)
    got = llama_probe(out, logits=[ids])["logits0"]
    assert_logits_close(got, ref)


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Per architecture, once: a checkpoint whose layers decide half the top-1s, and its GGUFs."""
    models: dict[str, tuple] = {}
    files: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str):  # noqa: ANN202
        if arch not in models:
            folder = tmp_path_factory.mktemp(f"layered-{arch}")
            models[arch] = (folder, *save_layered(folder, *make_checkpoint(folder, arch, peaked=True)))
        folder, ids, top1, share = models[arch]
        if (arch, outtype) not in files:
            out = tmp_path_factory.mktemp(f"gguf-{arch}") / f"{outtype}.gguf"
            files[arch, outtype] = convert.convert(folder, out, outtype=outtype, name="tiny").path
        return files[arch, outtype], ids, top1, share

    return get


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_top1_agrees(arch: str, outtype: str, layered) -> None:  # noqa: ANN001
    path, ids, top1, share = layered(arch, outtype)
    assert share >= LAYER_SHARE, "the layers must decide a good share of the predictions"
    assert top1_agreement(path, ids, top1) >= AGREEMENT[outtype]


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_broken_layer_fails_the_agreement_check(
    arch: str,
    outtype: str,
    layered,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    path, ids, top1, _ = layered(arch, outtype)
    broken = tmp_path / "broken.gguf"
    name = break_last_layer(path, broken)
    assert top1_agreement(broken, ids, top1) < AGREEMENT[outtype], f"{name} reversed went unseen"
