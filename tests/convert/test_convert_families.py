"""Families beyond Llama: the same file as llama.cpp's own converter, and the same greedy text as
transformers (SmolLM3's rope-less layers, Granite's multipliers, OLMo 2's post-norms, Phi-4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import (
    LOGIT_TEXT,
    TOKENIZER_OF,
    assert_logits_close,
    gguf_reader,
    gguf_tensors,
    llama_probe,
    need_asset,
    reference_gguf,
)
from gguf import GGUFReader

import convert
from convert.errors import ConvertError

FAMILIES = ["smollm3", "granite", "olmo2", "olmo3", "phi4"]
# Flags llama.cpp defaults to false that the vocabulary code leaves unwritten for byte-level BPE
# (it also writes some vocabulary keys llama.cpp's converter does not, e.g. the end-of-turn token).
IMPLICIT_FALSE = {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"}
# Phi-4 (14B)'s shape next to Phi-4-mini's: full rotary, no LongRoPE, an untied output.
PHI4_DENSE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 250000.0,
        "partial_rotary_factor": 1.0,
    },
    "tie_word_embeddings": False,
}



def _fields(r: GGUFReader) -> dict[str, object]:
    return {
        key: field.contents()
        for key, field in r.fields.items()
        if not key.startswith("GGUF.") and key != "general.name"
    }


def _as_reference_reads_it(folder: Path, arch: str) -> None:
    """The tokenizer files in the form llama.cpp's converter reads first for the family."""
    if TOKENIZER_OF[arch] == "llama2-spm":
        (folder / "tokenizer.json").unlink()
        shutil.copy(
            need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model"
        )
    if arch == "phi4":  # Phi-4 ships a GPT2Tokenizer; llama.cpp's Phi-3 code reads the class name
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text())
        config["tokenizer_class"] = "GPT2Tokenizer"
        path.write_text(json.dumps(config))


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["q8_0"])  # the architecture code is the same for all types
@pytest.mark.parametrize(
    ("arch", "config"),
    [(arch, None) for arch in FAMILIES] + [("phi4", PHI4_DENSE)],
    ids=[*FAMILIES, "phi4-dense"],
)
def test_same_file_as_llama_cpp_converter(
    arch: str,
    config: dict | None,
    outtype: str,
    checkpoints,  # noqa: ANN001
    llama_cpp_converter: Path,
    tmp_path: Path,
) -> None:
    folder = tmp_path / arch
    shutil.copytree(checkpoints(arch, **({"config": config} if config else {}))[0], folder)
    _as_reference_reads_it(folder, arch)
    ref = reference_gguf(llama_cpp_converter, folder, tmp_path / "ref.gguf", outtype)
    ours_path = convert.convert(folder, tmp_path / "ours.gguf", outtype=outtype).path
    ours = gguf_reader(ours_path)
    assert gguf_tensors(ours) == gguf_tensors(ref)  # names, types, shapes and bytes
    want, got = _fields(ref), _fields(ours)
    for key, value in want.items():
        if key in IMPLICIT_FALSE and value is False and key not in got:
            continue
        assert key in got, key
        assert got[key] == value, key
    extra = {key for key in set(got) - set(want) if not key.startswith("tokenizer.")}
    assert not extra  # no architecture key that llama.cpp's converter does not write


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_continuation_matches_transformers(arch: str, checkpoints, converted) -> None:  # noqa: ANN001
    import torch

    _, model, tok = checkpoints(arch)
    out = converted(arch, outtype="f32", name="tiny").path  # the file the f32 logit test checks
    prompt = tok.encode(LOGIT_TEXT[:200], add_special_tokens=False)
    if tok.bos_token_id is not None:
        prompt = [tok.bos_token_id, *prompt]
    n = 32
    with torch.no_grad():
        ids = model.float().generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    want = ids[0, len(prompt) :].tolist()
    got = llama_probe(out, generate={"ids": prompt, "n": n})["generated"].tolist()
    assert got == want
    assert len(set(want)) > 3  # a real continuation, not one repeated token


def _edit_config(folder: Path, **config: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))


@pytest.mark.parametrize(
    "change",
    [
        {"no_rope_layer_interval": 3, "no_rope_layers": None},
        {"no_rope_layers": [1, 0, 1, 1]},
    ],
)
def test_smollm3_rope_layers_llama_cpp_cannot_run_are_refused(
    change: dict, checkpoints, tmp_path: Path
) -> None:
    folder, _, _ = checkpoints("smollm3")
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    _edit_config(copy, **change)
    with pytest.raises(ConvertError, match="every 4th layer"):
        convert.convert(copy, tmp_path / "m.gguf", outtype="f32")
    assert not list(tmp_path.glob("*.gguf"))


def test_phi4_mini_hub_config_converts_the_same(checkpoints, tmp_path: Path) -> None:
    """Phi-4-mini's config.json on the Hub (flat rope keys, `rope_scaling` with `type`) and the
    transformers 5 layout give the same file."""
    folder, _, _ = checkpoints("phi4")
    hub = tmp_path / "hub"
    shutil.copytree(folder, hub)
    config = json.loads((hub / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"],
        rope_scaling={
            "type": "longrope",
            "long_factor": rope["long_factor"],
            "short_factor": rope["short_factor"],
        },
    )
    (hub / "config.json").write_text(json.dumps(config))
    a = gguf_reader(convert.convert(folder, tmp_path / "a.gguf", outtype="f16").path)
    b = gguf_reader(convert.convert(hub, tmp_path / "b.gguf", outtype="f16").path)
    assert _fields(b) == _fields(a)
    assert gguf_tensors(b) == gguf_tensors(a)
    fields = _fields(a)
    assert fields["phi3.rope.dimension_count"] == 12  # 0.75 of the 16-wide heads
    assert fields["phi3.attention.sliding_window"] == 0
    assert "output.weight" not in gguf_tensors(a)  # tied: llama.cpp reuses the embeddings
    factors = {t.name: np.asarray(t.data) for t in a.tensors if "rope_factors" in t.name}
    assert np.allclose(factors["rope_factors_short.weight"], rope["short_factor"])


def test_phi4_dense_shape_matches_transformers(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """Phi-4 (14B)'s shape: full rotary, no LongRoPE factors, untied output, grouped-query heads,
    no sliding window."""
    from convert_helpers import reference_logits

    folder, model, tok = checkpoints("phi4", config=PHI4_DENSE)
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny").path
    r = gguf_reader(out)
    fields = _fields(r)
    assert fields["phi3.rope.dimension_count"] == 16
    assert fields["phi3.attention.sliding_window"] == 0
    assert fields["phi3.attention.head_count_kv"] == 2
    names = set(gguf_tensors(r))
    assert "output.weight" in names and not any("rope_factors" in n for n in names)
    ids = tok.encode(LOGIT_TEXT, add_special_tokens=False)
    ref = reference_logits(model, ids)
    got = llama_probe(out, logits=[ids])["logits0"]
    assert_logits_close(got, ref)


def test_granite_ignores_head_dim(checkpoints, tmp_path: Path) -> None:
    """Granite's heads are hidden_size / heads wide whatever head_dim says (transformers and
    llama.cpp's converter both ignore it)."""
    folder, _, _ = checkpoints("granite")
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    _edit_config(copy, head_dim=32)
    fields = _fields(gguf_reader(convert.convert(copy, tmp_path / "m.gguf", outtype="f16").path))
    assert fields["granite.rope.dimension_count"] == 16
    assert "granite.attention.key_length" not in fields
    assert fields["granite.embedding_scale"] == pytest.approx(12.0)
    assert fields["granite.logit_scale"] == pytest.approx(4.0)


@pytest.mark.parametrize("stores_head", [False, True], ids=["embeddings-only", "lm-head-too"])
def test_tied_olmo2_gets_one_output_matrix(stores_head: bool, checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    # llama.cpp's OLMo 2 needs output.weight: the embeddings' copy, or the stored lm_head.
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "olmo2"
    shutil.copytree(checkpoints("olmo2", config={"tie_word_embeddings": True})[0], folder)
    weights = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in weights
    if stores_head:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    plan = convert.convert(folder, tmp_path / "m.gguf", outtype="f16", dry_run=True).plan
    assert plan is not None
    outputs = [t for t in plan.tensors if t.name == "output.weight"]
    want = "lm_head.weight" if stores_head else "model.embed_tokens.weight"
    assert [t.source for t in outputs] == [want]
    embd = next(t for t in plan.tensors if t.name == "token_embd.weight")
    assert outputs[0].shape == embd.shape


def test_olmo3_sliding_rope_llama_cpp_cannot_run_is_refused(checkpoints, tmp_path: Path) -> None:
    # llama.cpp's OLMo 3 graph gives the sliding layers plain rope at the full layers' base.
    folder, _, _ = checkpoints("olmo3")
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    rope = json.loads((copy / "config.json").read_text())["rope_parameters"]
    _edit_config(copy, rope_parameters={**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ConvertError, match="sliding-window layers' rope"):
        convert.convert(copy, tmp_path / "m.gguf", outtype="f32")
    assert not list(tmp_path.glob("*.gguf"))


def test_yarn_attention_factor_llama_cpp_ignores_is_refused(checkpoints, tmp_path: Path) -> None:
    # llama.cpp's YaRN scales attention by 0.1 ln(factor) + 1 whatever the file says.
    folder, _, _ = checkpoints("olmo3")
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    rope = json.loads((copy / "config.json").read_text())["rope_parameters"]
    full = {**rope["full_attention"], "attention_factor": 1.2}
    _edit_config(copy, rope_parameters={**rope, "full_attention": full})
    with pytest.raises(ConvertError, match="yarn attention factor 1.2"):
        convert.convert(copy, tmp_path / "m.gguf", outtype="f32")
    assert not list(tmp_path.glob("*.gguf"))
