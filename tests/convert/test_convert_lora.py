"""PEFT LoRA adapters: llama.cpp adapters that compute what PEFT computes, merges, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import LOGIT_TEXT, gguf_reader, gguf_tensors, llama_probe, reference_logits
from gguf import GGMLQuantizationType as Q

import convert
from convert.errors import ConvertError

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig: attention + MLP; embeddings, lm_head and per-module ranks/alphas; rsLoRA
# (with a per-module rank) on one layer only.
ADAPTERS = {
    "a": dict(r=8, lora_alpha=16, target_modules=ATTN_MLP),
    "b": dict(
        r=4,
        lora_alpha=4,
        target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj", "down_proj"],
        rank_pattern={"down_proj": 2, "model.layers.1.self_attn.v_proj": 6},
        alpha_pattern={"q_proj": 3},
    ),
    "rs": dict(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        rank_pattern={"down_proj": 4},
        target_modules=ATTN_MLP,
        layers_to_transform=[1],
    ),
}


def _base_model(folder: Path):  # noqa: ANN202
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


def make_adapter(base: Path, out: Path, seed: int = 0, dtype: str | None = None, **config) -> Path:
    """A PEFT LoRA on the base with random (non-zero) A and B, saved as PEFT saves it."""
    import peft
    import torch

    model = peft.get_peft_model(_base_model(base), peft.LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_embedding_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "lora_B" in name or "lora_embedding_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 / p.shape[-1] ** 0.5)
    if dtype:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    return out


def peft_logits(base: Path, adapters: list[tuple[Path, float]], ids: list[int]) -> np.ndarray:
    """transformers + PEFT with all adapters active at once, each at its scale."""
    import peft
    import torch
    from peft.tuners.lora import LoraLayer

    names = [f"ad{i}" for i in range(len(adapters))]
    model = peft.PeftModel.from_pretrained(_base_model(base), adapters[0][0], adapter_name=names[0])
    for name, (path, _) in zip(names[1:], adapters[1:], strict=True):
        model.load_adapter(path, adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, (_, scale) in zip(names, adapters, strict=True):
                module.set_scale(name, scale)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def assert_agree(got: np.ndarray, ref: np.ndarray) -> None:
    """The converter tests' f32 criterion: same top-1 everywhere, error below 1e-3 of the range."""
    assert got.shape == ref.shape
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert float(np.abs(got - ref).max()) < 1e-3 * float(ref.max() - ref.min())


def assert_differ(a: np.ndarray, b: np.ndarray) -> None:
    """The adapter must change the logits far beyond the tolerance, or agreement means nothing."""
    assert float(np.abs(a - b).max()) > 0.1 * float(b.max() - b.min())


@dataclass
class Env:
    folder: Path
    root: Path
    ids: list[int]
    base_gguf: Path
    adapters: dict[str, Path]
    base_ref: np.ndarray
    gguf: dict[str, Path]
    probes: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def env(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Env:  # noqa: ANN001
    folder, _, tok = checkpoints("llama")
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        name: make_adapter(folder, root / name, seed=i + 1, **cfg)
        for i, (name, cfg) in enumerate(ADAPTERS.items())
    }
    ids = [tok.bos_token_id] + tok.encode(LOGIT_TEXT, add_special_tokens=False)
    base_gguf = convert.convert(folder, root / "base.gguf", outtype="f32").path
    gguf_files = {
        name: convert.convert_adapter(path, folder, root / f"{name}.gguf", outtype="f32").path
        for name, path in adapters.items()
    }
    return Env(
        folder, root, ids, base_gguf, adapters, reference_logits(folder, ids), gguf_files, {}
    )


def runtime(env: Env, *loras: tuple[str, float]) -> np.ndarray:
    """llama.cpp's logits on the base GGUF with converted adapters applied (cached per set)."""
    key = repr(loras)
    if key not in env.probes:
        lora = [(env.gguf[name], scale) for name, scale in loras]
        env.probes[key] = llama_probe(env.base_gguf, logits=[env.ids], lora=lora)["logits0"]
    return env.probes[key]


# --- llama.cpp applies the converted adapter as PEFT does ----------------------------------------


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_logits_match_peft(name: str, env: Env) -> None:
    ref = peft_logits(env.folder, [(env.adapters[name], 1.0)], env.ids)
    assert_differ(ref, env.base_ref)
    assert_agree(runtime(env, (name, 1.0)), ref)


def test_scale_zero_gives_the_base(env: Env) -> None:
    assert_agree(runtime(env, ("a", 0.0)), env.base_ref)


def test_two_adapters_add_up_as_in_peft(env: Env) -> None:
    loras = [(env.adapters["a"], 1.0), (env.adapters["b"], 0.5)]
    ref = peft_logits(env.folder, loras, env.ids)
    assert_differ(ref, peft_logits(env.folder, loras[:1], env.ids))
    assert_agree(runtime(env, ("a", 1.0), ("b", 0.5)), ref)


def test_rslora_alpha_and_folded_patterns(env: Env) -> None:
    rs = convert.read_adapter(env.adapters["rs"])
    assert rs.gguf_alpha == pytest.approx(8 * 8**0.5)  # alpha / r = PEFT's alpha / sqrt(r)
    assert rs.ranks == (4, 8)
    assert {w.target.split(".")[2] for w in rs.weights.values()} == {"1"}  # layers_to_transform
    r = gguf_reader(env.gguf["rs"])
    assert r.fields["adapter.lora.alpha"].contents() == pytest.approx(8 * 8**0.5)
    # rank 4 under rsLoRA: PEFT scales by 8 / sqrt(4), llama.cpp by 8 * sqrt(8) / 4: folded in
    down = rs.weights["model.layers.1.mlp.down_proj.weight"]
    got = {t.name: np.asarray(t.data) for t in r.tensors}["blk.1.ffn_down.weight.lora_b"]
    assert np.allclose(got, down.b.read() * (8 / 4**0.5) / (8 * 8**0.5 / 4), rtol=1e-6)
    # b: alpha 4 at rank 4 is written. llama.cpp divides by each tensor's own rank, so the rank-2
    # down_proj is stored as is; q_proj's alpha 3 is folded into its lora_b (x 3 / 4).
    from convert.archs.base import permute_rows

    b = convert.read_adapter(env.adapters["b"])
    assert b.ranks == (2, 4, 6) and b.gguf_alpha == 4.0
    tensors = {t.name: np.asarray(t.data) for t in gguf_reader(env.gguf["b"]).tensors}
    w = {name.split(".", 1)[1]: x for name, x in b.weights.items()}  # without "model."
    assert np.array_equal(
        tensors["blk.0.ffn_down.weight.lora_b"], w["layers.0.mlp.down_proj.weight"].b.read()
    )
    q = w["layers.0.self_attn.q_proj.weight"].b.read()
    assert np.allclose(tensors["blk.0.attn_q.weight.lora_b"], permute_rows(4)(q) * 0.75, rtol=1e-6)
    emb = w["embed_tokens.weight"]  # llama.cpp gathers token rows of lora_a: (vocab, r)
    assert np.array_equal(tensors["token_embd.weight.lora_a"], emb.a.read().T)


# --- merging ------------------------------------------------------------------------------------


def test_merged_conversion_equals_the_runtime_adapters(env: Env) -> None:
    lora = [(env.adapters["a"], 1.0), (env.adapters["b"], 0.5)]
    out = env.root / "merged.gguf"
    res = convert.convert(env.folder, out, outtype="f32", lora=lora)
    merged = llama_probe(res.path, logits=[env.ids])["logits0"]
    assert_agree(merged, runtime(env, ("a", 1.0), ("b", 0.5)))
    assert_differ(merged, env.base_ref)


def test_merged_weight_is_w_plus_scaled_ba(env: Env, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    out = convert.convert(
        env.folder, tmp_path / "m.gguf", outtype="f32", lora=[(env.adapters["a"], 0.75)]
    )
    v = {t.name: np.array(t.data) for t in gguf_reader(out.path).tensors}["blk.1.attn_v.weight"]
    base = load_file(env.folder / "model.safetensors")["model.layers.1.self_attn.v_proj.weight"]
    ad = load_file(env.adapters["a"] / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_{}.weight"
    want = base + 0.75 * (16 / 8) * (ad[key.format("B")] @ ad[key.format("A")])
    assert np.allclose(v, want.numpy(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(torch.from_numpy(v), base)


def test_merge_keeps_the_auto_type_of_the_source(env: Env, tmp_path: Path) -> None:
    from convert_helpers import make_checkpoint

    bf16 = tmp_path / "bf16"
    make_checkpoint(bf16, "llama", dtype="bfloat16")
    plain = convert.convert(bf16, tmp_path / "p.gguf", dry_run=True).plan
    merged = convert.convert(bf16, tmp_path / "m.gguf", dry_run=True, lora=[(env.adapters["a"], 1)])
    assert merged.plan.written_type == plain.written_type == "bf16"
    assert [t.qtype for t in merged.plan.tensors] == [t.qtype for t in plain.tensors]
    assert convert.convert(bf16, dry_run=True, lora=[(env.adapters["a"], 1)]).path.name == (
        "bf16-a-BF16.gguf"
    )


def test_modules_to_save_replace_the_weight_when_merged(env: Env, tmp_path: Path) -> None:
    ad = make_adapter(
        env.folder,
        tmp_path / "mts",
        seed=7,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        modules_to_save=["lm_head"],
    )
    from safetensors.torch import load_file, save_file

    # PEFT saves the (here: untrained) copy: change it so that the replacement shows.
    state = load_file(ad / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in state
    state["base_model.model.lm_head.weight"] = state["base_model.model.lm_head.weight"] * 1.5 + 0.01
    save_file(state, ad / "adapter_model.safetensors", metadata={"format": "pt"})
    ref = peft_logits(env.folder, [(ad, 1.0)], env.ids)
    out = convert.convert(env.folder, tmp_path / "m.gguf", outtype="f32", lora=[(ad, 1.0)]).path
    assert_agree(llama_probe(out, logits=[env.ids])["logits0"], ref)
    output = {t.name: np.asarray(t.data) for t in gguf_reader(out).tensors}["output.weight"]
    assert np.array_equal(output, state["base_model.model.lm_head.weight"].numpy())


# --- the file -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_same_tensors_and_alpha_as_llama_cpp_converter(
    env: Env, llama_cpp_converter: Path, tmp_path: Path
) -> None:
    script = llama_cpp_converter / "convert_lora_to_gguf.py"
    assert script.is_file(), f"{script} is missing from the sdist"
    ref_path = tmp_path / "ref.gguf"
    proc = subprocess.run(
        [
            sys.executable,
            str(script),
            str(env.adapters["a"]),
            "--base",
            str(env.folder),
            "--outtype",
            "f32",
            "--outfile",
            str(ref_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(llama_cpp_converter / "gguf-py")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert gguf_tensors(env.gguf["a"]) == gguf_tensors(ref_path)  # names, types, shapes and bytes
    ref, ours = gguf_reader(ref_path), gguf_reader(env.gguf["a"])
    for key in ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"):
        assert ours.fields[key].contents() == ref.fields[key].contents(), key


def test_pickled_adapter_gives_the_same_file(env: Env, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    folder = tmp_path / "bin"
    shutil.copytree(env.adapters["a"], folder)
    state = load_file(folder / "adapter_model.safetensors")
    (folder / "adapter_model.safetensors").unlink()
    torch.save(state, folder / "adapter_model.bin")
    res = convert.convert_adapter(folder, env.folder, tmp_path / "a.gguf", outtype="f32")
    assert gguf_tensors(res.path) == gguf_tensors(env.gguf["a"])


def test_gguf_base_gives_the_same_adapter(env: Env, tmp_path: Path) -> None:
    res = convert.convert_adapter(
        env.adapters["a"], env.base_gguf, tmp_path / "a.gguf", outtype="f32"
    )
    assert res.arch == "llama" and res.n_tensors == 28
    assert gguf_tensors(res.path) == gguf_tensors(env.gguf["a"])


def test_result_types_and_default_output(env: Env, tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "my-adapter"
    shutil.copytree(env.adapters["a"], folder)
    assert convert.is_adapter_dir(folder) and not convert.is_adapter_dir(env.folder)
    ad = convert.read_adapter(folder)
    assert ad.base_model == str(env.folder) and ad.target_modules == tuple(sorted(ATTN_MLP))
    plan = convert.convert_adapter(folder, env.folder, dry_run=True)
    assert plan.path == folder / "my-adapter-F32-LoRA.gguf" and not plan.path.exists()
    assert (plan.rank, plan.ranks, plan.alpha, plan.n_tensors) == (8, (8,), 16.0, 28)
    assert plan.targets == tuple(sorted(ATTN_MLP)) and plan.base_model == str(env.folder)
    assert "rank: 8\n" in plan.describe() and "28 tensors" in plan.describe()
    res = convert.convert_adapter(folder, env.folder, outtype="f16", name="tuned")
    r = gguf_reader(res.path)
    assert {t.tensor_type for t in r.tensors} == {Q.F16}
    assert r.fields["general.name"].contents() == "tuned"
    with pytest.raises(ConvertError, match="already exists"):
        convert.convert_adapter(folder, env.folder, res.path)
    # a BF16 adapter stays BF16, bit for bit
    bf = make_adapter(
        env.folder, tmp_path / "bf", seed=3, dtype="bfloat16", r=4, target_modules=["o_proj"]
    )
    out = convert.convert_adapter(bf, env.folder, tmp_path / "bf.gguf")
    got = {t.name: (t.tensor_type, bytes(t.data)) for t in gguf_reader(out.path).tensors}
    from safetensors import safe_open

    with safe_open(bf / "adapter_model.safetensors", "pt") as f:
        a0 = f.get_tensor("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight")
    assert got["blk.0.attn_output.weight.lora_a"] == (
        Q.BF16,
        a0.view(__import__("torch").int16).numpy().tobytes(),
    )


# --- bad input ----------------------------------------------------------------------------------


def _other_model_adapter(out: Path) -> Path:
    """A LoRA trained for a smaller Llama (hidden 32): same module names, other shapes."""
    import peft
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
    )
    model = peft.get_peft_model(
        tf.LlamaForCausalLM(cfg),
        peft.LoraConfig(r=4, target_modules=ATTN_MLP, init_lora_weights=False),
    )
    model.save_pretrained(out)
    return out


def _peft(base: Path, out: Path, config) -> Path:  # noqa: ANN001
    import peft

    peft.get_peft_model(_base_model(base), config).save_pretrained(out)
    return out


def _bad(kind: str, env: Env, tmp: Path) -> tuple[Path, Path]:
    """(adapter folder, base) for each kind of bad input."""
    import peft

    folder = env.folder
    if kind == "other-base":
        return _other_model_adapter(tmp / "other"), folder
    if kind == "missing-base":
        return env.adapters["a"], tmp / "no-such-model"
    if kind == "base-not-a-model":
        (tmp / "notes.txt").write_text("not a model")
        return env.adapters["a"], tmp / "notes.txt"
    if kind == "ia3":
        return _peft(
            folder,
            tmp / "ia3",
            peft.IA3Config(
                target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
            ),
        ), folder
    if kind == "prompt-tuning":
        return _peft(
            folder, tmp / "pt", peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
        ), folder
    if kind == "dora":
        return _peft(
            folder, tmp / "dora", peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
        ), folder
    if kind == "modules-to-save":
        cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
        return _peft(folder, tmp / "mts", cfg), folder
    if kind == "tied-base":
        from convert_helpers import make_checkpoint

        make_checkpoint(tmp / "tied", "llama", peaked=True)  # lm_head tied to the embeddings
        return env.adapters["b"], tmp / "tied"
    if kind == "a-without-b":
        from safetensors.torch import load_file, save_file

        ad = make_adapter(folder, tmp / "half", r=4, target_modules=["q_proj"])
        state = load_file(ad / "adapter_model.safetensors")
        del state["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
        save_file(state, ad / "adapter_model.safetensors")
        return ad, folder
    if kind == "no-weights":
        ad = make_adapter(folder, tmp / "empty", r=4, target_modules=["q_proj"])
        (ad / "adapter_model.safetensors").unlink()
        return ad, folder
    raise ValueError(kind)


BAD = {
    "other-base": (
        "down_proj of layer 0 expects a 32x64 weight, the base 'ckpt-llama",
        "has 64x128",
        "--base",
    ),
    "missing-base": ("does not exist", "--base"),
    "base-not-a-model": ("not a GGUF file",),
    "ia3": ("peft_type IA3", "not LORA"),
    "prompt-tuning": ("peft_type PROMPT_TUNING", "virtual tokens"),
    "dora": ("DoRA", "llama.cpp has no DoRA"),
    "modules-to-save": (
        "lm_head.weight",
        "modules_to_save",
        "localrun convert BASE_DIR --lora ADAPTER_DIR",
    ),
    "tied-base": ("updates lm_head", "ties to its token embeddings", "target_modules"),
    "a-without-b": ("lora_A but no lora_B", "q_proj of layer 1"),
    "no-weights": ("no adapter_model.safetensors or adapter_model.bin",),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_one_clear_error_and_leaves_nothing(
    kind: str, env: Env, tmp_path: Path
) -> None:
    adapter, base = _bad(kind, env, tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    before = sorted(p.name for p in adapter.iterdir())
    with pytest.raises(ConvertError) as e:
        convert.convert_adapter(adapter, base, out_dir / "x.gguf")
    text = str(e.value)
    assert "\n" not in text
    for part in BAD[kind]:
        assert part in text
    assert list(out_dir.iterdir()) == []
    assert sorted(p.name for p in adapter.iterdir()) == before  # no default output, no temp file


def test_merge_of_an_adapter_for_another_model_fails_before_writing(
    env: Env, tmp_path: Path
) -> None:
    other = _other_model_adapter(tmp_path / "other")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ConvertError, match="expects a 32x64 weight") as e:
        convert.convert(env.folder, out / "m.gguf", outtype="f32", lora=[(other, 1.0)])
    assert "pass the right one with --base" in str(e.value)
    assert list(out.iterdir()) == []


def test_a_failing_write_leaves_no_temp_file(
    env: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from convert import converter

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError("disk full")

    monkeypatch.setattr(converter, "_tensor_bytes", boom)
    with pytest.raises(OSError, match="disk full"):
        convert.convert_adapter(env.adapters["a"], env.folder, tmp_path / "a.gguf")
    assert list(tmp_path.iterdir()) == []


def test_adapter_config_json_is_read_as_is(env: Env) -> None:
    cfg = json.loads((env.adapters["b"] / "adapter_config.json").read_text())
    ad = convert.read_adapter(env.adapters["b"])
    q = ad.weights["model.layers.0.self_attn.q_proj.weight"]
    assert (q.rank, q.alpha, q.scaling) == (4, 3.0, 0.75)
    assert cfg["rank_pattern"] == {"down_proj": 2, "model.layers.1.self_attn.v_proj": 6}
    assert ad.weights["model.layers.1.self_attn.v_proj.weight"].rank == 6
    assert ad.weights["model.layers.0.self_attn.v_proj.weight"].rank == 4
