"""Mixture-of-experts conversion: each layer's experts stacked into llama.cpp's merged tensors.

Every family computes what transformers computes (with routing that varies across positions, so
a wrong expert order or router would show), writes what llama.cpp's own converter writes, and a
conversion holds at most about one layer's experts in memory.
"""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import (
    AGREEMENT,
    LAYER_SHARE,
    _tokenizer,
    assert_logits_close,
    break_last_layer,
    gguf_reader,
    gguf_tensors,
    greedy,
    llama_probe,
    logit_ids,
    logits_and_routes,
    make_checkpoint,
    model_keys,
    need_asset,
    reference_gguf,
    save_layered,
    top1_agreement,
)

import convert
from convert import converter, writer
from convert.errors import ConvertError

N_EXPERT, N_USED = 8, 2
TOKENIZER_OF = {
    "mixtral": "llama2-spm",
    "qwen2moe": "qwen3",
    "qwen3moe": "qwen3",
    "olmoe": "qwen3",  # llama.cpp's converter reads OLMoE's tokenizer as BPE only
    "granitemoe": "llama2-spm",
    "granitemoeshared": "llama2-spm",
}
FAMILIES = list(TOKENIZER_OF)
# Peaked models (see randomize()): how much to scale the layers' output projections so that the
# layers decide some predictions against the dominant tied embeddings.
GAIN = {
    "mixtral": 1.5,
    "qwen2moe": 1.5,
    "qwen3moe": 1.25,
    "olmoe": 1.5,
    "granitemoe": 10.0,
    "granitemoeshared": 10.0,
}


def _config(family: str, tok, peaked: bool):  # noqa: ANN001, ANN202
    import transformers as tf

    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=peaked,
        num_experts_per_tok=N_USED,
    )
    if family == "mixtral":
        return tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=N_EXPERT)
    if family == "qwen2moe":
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=N_EXPERT,
            norm_topk_prob=False,
        )
    if family == "qwen3moe":
        return tf.Qwen3MoeConfig(
            **common,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=N_EXPERT,
            norm_topk_prob=True,
        )
    if family == "olmoe":  # llama.cpp's olmoe normalizes K over all heads: no grouped KV heads
        common["num_key_value_heads"] = common["num_attention_heads"]
        return tf.OlmoeConfig(**common, intermediate_size=32, num_experts=N_EXPERT)
    if family.startswith("granitemoe"):
        granite = dict(
            intermediate_size=32,
            num_local_experts=N_EXPERT,
            embedding_multiplier=4.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.0,
        )
        if family == "granitemoeshared":
            return tf.GraniteMoeSharedConfig(**common, **granite, shared_intermediate_size=48)
        return tf.GraniteMoeConfig(**common, **granite)
    raise ValueError(family)


def build(folder: Path, family: str, *, peaked: bool = False):  # noqa: ANN201
    """A random-weight MoE checkpoint in Hugging Face layout with a real tokenizer."""
    return make_checkpoint(
        folder,
        family,
        peaked=peaked,
        config=lambda tok, peaked: _config(family, tok, peaked),
        tokenizer=TOKENIZER_OF[family],
        gain=GAIN[family] if peaked else 1.0,
    )


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Each family's tiny checkpoint, built once per module."""
    cache: dict[tuple[str, bool], tuple] = {}

    def get(family: str, peaked: bool = False):  # noqa: ANN202
        if (family, peaked) not in cache:
            folder = tmp_path_factory.mktemp(f"moe-{family}")
            model, tok = build(folder, family, peaked=peaked)
            cache[family, peaked] = (folder, model, tok)
        return cache[family, peaked]

    return get


@pytest.fixture(scope="module")
def f16(moe, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """Each family's plain checkpoint converted to F16 once (the default name), and its reader (a
    reader of a Qwen3-vocabulary file takes seconds)."""
    cache: dict[str, tuple] = {}

    def get(family: str):  # noqa: ANN202
        if family not in cache:
            folder, _, _ = moe(family)
            out = tmp_path_factory.mktemp(f"moe-f16-{family}") / "m.gguf"
            path = convert.convert(folder, out, outtype="f16").path
            cache[family] = (path, gguf_reader(path))
        return cache[family]

    return get


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Per family, once: a peaked checkpoint calibrated so that its layers decide LAYER_SHARE of
    the top-1s (make_layered), its F16 file, the ids, transformers' top-1s and the share."""
    cache: dict[str, tuple] = {}

    def get(family: str):  # noqa: ANN202
        if family not in cache:
            folder = tmp_path_factory.mktemp(f"moe-layered-{family}")
            ids, top1, share = save_layered(folder, *build(folder, family, peaked=True))
            out = tmp_path_factory.mktemp(f"moe-layered-f16-{family}") / "m.gguf"
            path = convert.convert(folder, out, outtype="f16", name="tiny").path
            cache[family] = (path, ids, top1, share)
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_logits_and_greedy_match_transformers(family: str, moe, tmp_path: Path) -> None:  # noqa: ANN001
    folder, model, tok = moe(family)
    ids = logit_ids(tok)
    ref, routes = logits_and_routes(model, ids, N_USED)
    assert len(routes) == 2  # one per layer, both MoE
    for layer in routes:
        # Routing varies: a wrong expert order or router would change many positions' outputs.
        _, counts = np.unique(layer, axis=0, return_counts=True)
        assert counts.max() <= len(ids) * 2 / 3, "most positions route to the same experts"
        assert len(set(layer.ravel().tolist())) >= N_EXPERT - 2, "most experts are never used"
    res = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny")
    out, plan = res.path, res.plan
    prompt = ids[:12]
    want = greedy(model, prompt, 24)
    got = llama_probe(out, logits=[ids], generate={"ids": prompt, "n": 24})
    assert_logits_close(got["logits0"], ref)
    assert list(got["generated"]) == want
    assert len(set(want)) > 3  # a continuation, not one repeated token
    # The plan (what --dry-run shows) has the stacked tensors, and the file holds what it planned.
    shapes = {t.name: t.shape for t in plan.tensors}
    n_ff = int(
        model.config.to_dict().get("moe_intermediate_size") or model.config.intermediate_size
    )
    assert shapes["blk.1.ffn_gate_exps.weight"] == (N_EXPERT, n_ff, 64)
    assert shapes["blk.1.ffn_up_exps.weight"] == (N_EXPERT, n_ff, 64)
    assert shapes["blk.1.ffn_down_exps.weight"] == (N_EXPERT, 64, n_ff)
    assert plan.gguf_bytes < out.stat().st_size < plan.gguf_bytes + (16 << 20)


@pytest.mark.parametrize("family", FAMILIES)
def test_f16_top1_agrees(family: str, layered) -> None:  # noqa: ANN001
    out, ids, top1, share = layered(family)
    assert share >= LAYER_SHARE, "the layers must decide a good share of the predictions"
    assert (top1 != np.asarray(ids)).mean() >= 0.03, "the layers must decide some predictions"
    agreement = top1_agreement(out, ids, top1)
    assert agreement >= 0.99
    assert agreement >= AGREEMENT["f16"]


@pytest.mark.parametrize("family", FAMILIES)
def test_broken_layer_fails_the_agreement_check(family: str, layered, tmp_path: Path) -> None:  # noqa: ANN001
    out, ids, top1, _ = layered(family)
    broken = tmp_path / "broken.gguf"
    name = break_last_layer(out, broken)
    assert top1_agreement(broken, ids, top1) < AGREEMENT["f16"], f"{name} reversed went unseen"


# Qwen3-MoE and OLMoE name their in-memory experts as Qwen2-MoE does.
@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "granitemoe"])
def test_from_module_matches_folder_conversion(family: str, moe, f16, tmp_path: Path) -> None:  # noqa: ANN001
    # In memory, transformers 5 fuses each layer's experts into 3D tensors (gate_up_proj,
    # down_proj); on disk it saves them per expert (or, for Granite, as input/output_linear).
    _, model, tok = moe(family)
    assert any("experts.gate_up_proj" in k for k in model.state_dict())
    a = convert.from_module(model, tok, tmp_path / "mem.gguf", outtype="f16", name="m").path
    _, disk = f16(family)  # the folder's conversion (its name is metadata, not a tensor)
    assert gguf_tensors(gguf_reader(a)) == gguf_tensors(disk)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_same_file_as_llama_cpp_converter(
    family: str, moe, f16, llama_cpp_converter: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    src, _, _ = moe(family)
    folder = tmp_path / family
    shutil.copytree(src, folder)
    if TOKENIZER_OF[family] == "llama2-spm":
        # the Llama 2 SentencePiece model, which both converters read first
        (folder / "tokenizer.json").unlink()
        shutil.copy(
            need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model"
        )
        ours_path = convert.convert(folder, tmp_path / "ours.gguf", outtype="f16").path
        ours = gguf_reader(ours_path)
    else:  # the folder as it was: its shared conversion
        _, ours = f16(family)
    ref = reference_gguf(llama_cpp_converter, folder, tmp_path / "ref.gguf", "f16")
    assert gguf_tensors(ours) == gguf_tensors(ref)  # names, types, shapes and bytes
    # The model's metadata (the vocabulary's is the tokenizer tests' business).
    assert model_keys(ours) == model_keys(ref)


def test_peak_memory_is_about_one_layer_of_experts(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    import torch
    import transformers as tf

    tok = _tokenizer("llama2-spm")
    hidden, n_ff, layers = 256, 512, 6
    config = tf.MixtralConfig(
        hidden_size=hidden,
        intermediate_size=n_ff,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tok),
        num_local_experts=N_EXPERT,
        num_experts_per_tok=N_USED,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "big"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    layer_experts = N_EXPERT * 3 * n_ff * hidden * 4  # F32 bytes of one layer's experts
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert total > 4 * layer_experts  # holding the model (or most of it) would show
    # Work items smaller than the default 8 MB, so that the bound says something at this size.
    monkeypatch.setattr(writer, "BLOCK_BYTES", 1 << 20)
    threads = 2
    write = converter.write_model
    seen: dict[str, int] = {}

    def measured(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        # The writing only: the tokenizer, read before, is not the experts' business.
        seen["start"] = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        write(*args, **kwargs)
        seen["peak"] = tracemalloc.get_traced_memory()[1]

    monkeypatch.setattr(converter, "write_model", measured)
    tracemalloc.start()
    try:
        out = convert.convert(folder, tmp_path / "m.gguf", outtype="f16", threads=threads).path
    finally:
        tracemalloc.stop()
    assert out.stat().st_size > total / 2 * 0.9
    grown = seen["peak"] - seen["start"]
    in_flight = 4 * threads * writer.BLOCK_BYTES  # the writer's queue of blocks, with copies
    assert grown < layer_experts + in_flight, f"writing took {grown / 1e6:.1f} MB"


def test_config_that_llama_cpp_would_compute_differently_is_refused(moe, tmp_path: Path) -> None:  # noqa: ANN001
    src, _, _ = moe("qwen3moe")
    folder = tmp_path / "q"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["norm_topk_prob"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="norm_topk_prob"):
        convert.convert(folder, dry_run=True)


def test_missing_expert_is_named(moe, tmp_path: Path) -> None:  # noqa: ANN001
    from safetensors.torch import load_file, save_file

    src, _, _ = moe("mixtral")
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConvertError, match=r"layer 1 .*w3.*missing: 5"):
        convert.convert(folder, dry_run=True)
