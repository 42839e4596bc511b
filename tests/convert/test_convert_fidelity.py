"""Converted GGUF files compute what the PyTorch model computes (llama.cpp vs transformers)."""

from __future__ import annotations

import numpy as np
import pytest
from convert_helpers import ARCHS, LOGIT_TEXT, llama_probe, reference_logits

import convert


def _ids(tok) -> list[int]:  # noqa: ANN001
    ids = tok.encode(LOGIT_TEXT, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(arch: str, checkpoints, tmp_path) -> None:  # noqa: ANN001
    folder, model, tok = checkpoints(arch)
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny").path
    ids = _ids(tok)
    ref = reference_logits(model, ids)
    got = llama_probe(out, logits=[ids])["logits0"]
    assert got.shape == ref.shape
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    span = float(ref.max() - ref.min())
    assert float(np.abs(got - ref).max()) < 1e-3 * span


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_top1_agrees(arch: str, outtype: str, checkpoints, tmp_path) -> None:  # noqa: ANN001
    # A peaked model: clear winners at most positions, as in trained models (see randomize()).
    folder, model, tok = checkpoints(arch, peaked=True)
    out = convert.convert(folder, tmp_path / "m.gguf", outtype=outtype, name="tiny").path
    ids = _ids(tok)
    ref = reference_logits(model, ids)
    top1 = ref.argmax(-1)
    assert (top1 != np.asarray(ids)).mean() >= 0.03, "the layers must decide some predictions"
    got = llama_probe(out, logits=[ids])["logits0"]
    assert (got.argmax(-1) == top1).mean() >= 0.99
