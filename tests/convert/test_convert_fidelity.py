"""Converted GGUF files compute what the PyTorch model computes (llama.cpp vs transformers)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import ARCHS, LOGIT_TEXT, llama_probe, make_checkpoint, reference_logits
from gguf import GGUFReader

import convert

# Top-1 agreement a file must reach on a model whose layers decide half the top-1s (make_layered):
# measured f16 1.00, q8_0 0.97-1.00, q4_k_m 0.92; with one layer broken, 0.44-0.76.
AGREEMENT = {"f16": 0.99, "q8_0": 0.95, "q4_k_m": 0.85}
LAYER_SHARE = 0.5  # the share of positions whose top-1 the layers decide
HUBS, HUB_SCALE = 64, 3.0  # frequent tokens and how much longer their embeddings are


def logit_ids(tok) -> list[int]:  # noqa: ANN001
    """LOGIT_TEXT's token ids, after BOS where the tokenizer has one."""
    ids = tok.encode(LOGIT_TEXT, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


def _layerless_top1(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """Top-1 of the model with its decoder layers removed: what the embeddings alone predict."""
    import torch

    decoder = model.get_decoder()
    layers = decoder.layers
    decoder.layers = torch.nn.ModuleList()
    try:
        return reference_logits(model, ids).argmax(-1)
    finally:
        decoder.layers = layers


def layer_share(model, ids: list[int], layerless: np.ndarray | None = None) -> float:  # noqa: ANN001
    """Share of positions where the layers change the top-1 that the embeddings alone give."""
    if layerless is None:
        layerless = _layerless_top1(model, ids)
    return float((reference_logits(model, ids).argmax(-1) != layerless).mean())


def make_layered(model, ids: list[int], seed: int = 0) -> float:  # noqa: ANN001
    """Rescale a peaked model's tied embeddings so that the layers decide LAYER_SHARE of the top-1s.

    A few frequent tokens get longer embeddings (as in trained models), so that where the layers
    decide there is still a clear winner; the whole matrix is then scaled down until the layers
    outweigh the embedding at half the positions (the pre-norms keep their outputs as they were).
    Returns the share reached.
    """
    import torch

    emb = model.get_input_embeddings().weight
    rng = np.random.default_rng(seed)
    vocab = emb.shape[0]
    hubs = rng.choice(np.setdiff1d(np.arange(vocab), ids), HUBS, replace=False)
    with torch.no_grad():
        emb[torch.from_numpy(hubs)] *= HUB_SCALE
    base = emb.detach().clone()
    layerless = _layerless_top1(model, ids)  # the final norm makes it independent of the scale
    lo, hi = 0.1, 4.0
    for _ in range(7):  # bisection: the share falls as the embedding grows
        mid = (lo + hi) / 2
        with torch.no_grad():
            emb.copy_(base * mid)
        if layer_share(model, ids, layerless) >= LAYER_SHARE:
            lo = mid
        else:
            hi = mid
    with torch.no_grad():
        emb.copy_(base * lo)
    return layer_share(model, ids, layerless)


def top1_agreement(path: Path, ids: list[int], top1: np.ndarray) -> float:
    """Share of positions where llama.cpp on the GGUF picks the reference's top-1."""
    got = llama_probe(path, logits=[ids])["logits0"]
    return float((got.argmax(-1) == top1).mean())


def break_last_layer(src: Path, dst: Path) -> str:
    """Copy src to dst with the last block's FFN output rows reversed (a wrong layout); returns it."""
    shutil.copyfile(src, dst)
    reader = GGUFReader(dst, "r+")
    downs = [t for t in reader.tensors if ".ffn_down" in t.name]
    tensor = max(downs, key=lambda t: int(t.name.split(".")[1]))
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    rows[...] = rows[::-1].copy()
    reader.data.flush()
    del reader
    return tensor.name


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_logits_match_transformers(arch: str, checkpoints, tmp_path) -> None:  # noqa: ANN001
    folder, model, tok = checkpoints(arch)
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny").path
    ids = logit_ids(tok)
    ref = reference_logits(model, ids)
    got = llama_probe(out, logits=[ids])["logits0"]
    assert got.shape == ref.shape
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    span = float(ref.max() - ref.min())
    assert float(np.abs(got - ref).max()) < 1e-3 * span


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Per architecture, once: a checkpoint whose layers decide half the top-1s, and its GGUFs."""
    models: dict[str, tuple] = {}
    files: dict[tuple[str, str], Path] = {}

    def get(arch: str, outtype: str):  # noqa: ANN202
        if arch not in models:
            folder = tmp_path_factory.mktemp(f"layered-{arch}")
            model, tok = make_checkpoint(folder, arch, peaked=True)
            ids = logit_ids(tok)
            share = make_layered(model, ids)
            model.save_pretrained(folder)
            models[arch] = (folder, ids, reference_logits(model, ids).argmax(-1), share)
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
