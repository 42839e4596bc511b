"""llama.cpp quantization types through llama_model_quantize, with and without an imatrix."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from convert_helpers import (
    AGREEMENT,
    LAYER_SHARE,
    break_last_layer,
    gguf_reader,
    logit_ids,
    make_checkpoint,
    make_layered,
    randomize,
    reference_logits,
    top1_agreement,
)
from gguf import GGMLQuantizationType as Q

import convert
from convert.errors import ConvertError
from convert.imatrix import load_imatrix


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """K-quants need rows of 256: a Llama with hidden 256 whose layers decide half the top-1s."""
    import transformers as tf

    folder = tmp_path_factory.mktemp("wide")
    model, tok = make_checkpoint(folder, "llama", peaked=True)
    cfg = tf.LlamaConfig.from_pretrained(folder)
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = 256, 512, 64
    cfg.num_attention_heads, cfg.num_key_value_heads = 4, 2
    big = tf.LlamaForCausalLM(cfg)
    big.tie_weights()
    randomize(big, peaked=True)
    big.eval()
    share = make_layered(big, logit_ids(tok))
    assert share >= LAYER_SHARE, "the layers must decide a good share of the predictions"
    big.save_pretrained(folder)
    return folder, big, tok


@pytest.fixture(scope="module")
def q4_k_m(wide, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """The wide model in Q4_K_M, made once: the result, its progress events, ids and reference top-1."""
    folder, model, tok = wide
    out = tmp_path_factory.mktemp("q4_k_m")
    events: list[convert.Progress] = []
    res = convert.convert(folder, out / "m.gguf", outtype="q4_k_m", progress=events.append)
    ids = logit_ids(tok)
    return res, events, ids, reference_logits(model, ids).argmax(-1)


def _types(path: Path) -> dict[str, Q]:
    return {t.name: Q(t.tensor_type) for t in gguf_reader(path).tensors}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_q4_k_m_end_to_end(q4_k_m) -> None:  # noqa: ANN001
    res, events, ids, top1 = q4_k_m
    assert _leftovers(res.path.parent) == ["m.gguf"]  # the F16 intermediate is gone
    types = _types(res.path)
    assert types["blk.0.attn_q.weight"] == Q.Q4_K
    assert Q.Q6_K in types.values()  # the _M mix keeps some tensors at 6 bits
    assert types["blk.0.attn_norm.weight"] == Q.F32
    assert {e.stage for e in events} == {"convert", "quantize"}
    r = gguf_reader(res.path)
    assert r.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert top1_agreement(res.path, ids, top1) >= AGREEMENT["q4_k_m"]


def test_broken_layer_fails_the_q4_k_m_agreement_check(q4_k_m, tmp_path: Path) -> None:  # noqa: ANN001
    res, _, ids, top1 = q4_k_m
    name = break_last_layer(res.path, tmp_path / "broken.gguf")
    assert top1_agreement(tmp_path / "broken.gguf", ids, top1) < AGREEMENT["q4_k_m"], name


def _write_imatrix(path: Path, model_gguf: Path, seed: int = 0) -> None:
    """An importance matrix in llama-imatrix's GGUF format for every 2-D weight of a model."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["test"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 512)
    for t in gguf_reader(model_gguf).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            n = int(t.shape[0])  # ggml order: the row length first
            w.add_tensor(
                f"{t.name}.in_sum2", (rng.random(n, dtype=np.float32) ** 8 * 100).reshape(1, n)
            )
            w.add_tensor(f"{t.name}.counts", np.array([[10.0]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_imatrix_changes_the_quantization(wide, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = wide
    f16 = convert.convert(folder, tmp_path / "f16.gguf", outtype="f16").path
    imat = tmp_path / "imatrix.gguf"
    _write_imatrix(imat, f16)
    plain = convert.quantize(f16, tmp_path / "plain.gguf", "iq4_xs")
    weighted = convert.quantize(f16, tmp_path / "weighted.gguf", "iq4_xs", imatrix=imat)
    a = {t.name: bytes(t.data) for t in gguf_reader(plain).tensors}
    b = {t.name: bytes(t.data) for t in gguf_reader(weighted).tensors}
    assert a.keys() == b.keys()
    assert a["blk.0.ffn_down.weight"] != b["blk.0.ffn_down.weight"]
    assert _types(weighted)["blk.0.ffn_down.weight"] in (Q.IQ4_XS, Q.Q5_K, Q.Q6_K, Q.Q4_K)
    # a type that needs an imatrix: refused without one, made with one
    with pytest.raises(ConvertError, match="importance matrix"):
        convert.quantize(f16, tmp_path / "iq2.gguf", "iq2_xxs")
    out = convert.quantize(f16, tmp_path / "iq2.gguf", "iq2_xxs", imatrix=imat)
    assert Q.IQ2_XXS in _types(out).values()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_quantize_failure_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ConvertError, match="could not quantize"):
        convert.quantize(bad, tmp_path / "out.gguf", "q4_0")
    assert _leftovers(tmp_path) == ["bad.gguf"]


def test_legacy_imatrix_format_reads_the_same(tmp_path: Path) -> None:
    values = np.arange(1, 9, dtype=np.float32) * 3
    legacy = tmp_path / "imatrix.dat"
    name = b"blk.0.attn_q.weight"
    legacy.write_bytes(
        struct.pack("<ii", 1, len(name)) + name + struct.pack("<ii", 3, 8) + values.tobytes()
    )
    got = load_imatrix(legacy)
    assert np.allclose(got["blk.0.attn_q.weight"], values / 3)


def test_unknown_outtype_lists_choices(wide, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = wide
    with pytest.raises(ConvertError, match="q4_k_m"):
        convert.convert(folder, tmp_path / "m.gguf", outtype="q4_k_z")
    with pytest.raises(ConvertError, match="--imatrix"):
        convert.convert(folder, tmp_path / "m.gguf", outtype="f16", imatrix=tmp_path / "x")
