"""gpt-oss conversion: attention sinks, alternating sliding-window layers, a biased router and biased
experts (16-bit fused gate/up, or MXFP4 blocks kept as MXFP4).

The published tokenizer (o200k harmony) is not available offline, so these checkpoints carry the
Qwen3 byte-level BPE tokenizer from ../shared/assets; the vocabulary is not what is tested here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import (
    AGREEMENT,
    LAYER_SHARE,
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
    reference_gguf,
    save_layered,
    top1_agreement,
)
from gguf import GGMLQuantizationType

import convert
from convert.archs.gpt_oss import mxfp4_repack
from convert.errors import ConvertError

N_EXPERT, N_USED, HIDDEN, N_FF, WINDOW = 8, 2, 64, 96, 4
# OCP MX e2m1 values, index = nibble (as OpenAI's checkpoints and transformers read them).
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _config(tok, peaked: bool):  # noqa: ANN001, ANN202
    import transformers as tf

    return tf.GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=N_FF,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=N_EXPERT,
        num_experts_per_tok=N_USED,
        vocab_size=len(tok),
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        # gpt-oss's YaRN (factor 32 over 4096 positions), with the correction range rounded:
        # llama.cpp always rounds it, the published config's "truncate": false does not
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": True,
        },
        rms_norm_eps=1e-5,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=peaked,
    )


def build(folder: Path, *, peaked: bool = False):  # noqa: ANN201
    """A random-weight gpt-oss checkpoint in transformers 5's 16-bit layout."""
    return make_checkpoint(
        folder, "gpt_oss", peaked=peaked, config=_config, tokenizer="qwen3", gain=1.5 if peaked else 1.0
    )


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., cols] float32 as OpenAI's MXFP4: blocks uint8 [..., cols/32, 16] (element 2j in the
    low nibble of byte j, 2j + 1 in the high one) and E8M0 scales uint8 [..., cols/32]."""
    g = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(g).max(-1)
    e = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, 0).astype(np.int32)
    scaled = g / np.ldexp(np.float32(1), e)[..., None]
    idx = np.abs(scaled[..., None] - FP4).argmin(-1).astype(np.uint8)
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    # contiguous: safetensors.numpy writes a strided array's memory, not its values
    return np.ascontiguousarray(blocks), np.ascontiguousarray(e + 127, dtype=np.uint8)


def build_mxfp4(src: Path, folder: Path) -> dict[str, np.ndarray]:
    """The 16-bit checkpoint at src with its experts as MXFP4, laid out and named as the published
    gpt-oss checkpoints are; returns the blocks and scales written."""
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    shutil.copytree(src, folder)
    state = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    out: dict[str, np.ndarray] = {}
    for name in list(state):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            # transformers' [n_expert, in, out] is stored as [n_expert, out, in/32, 16]
            blocks, scales = mxfp4(state.pop(name).swapaxes(-1, -2))
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
    state.update(out)
    (folder / "model.safetensors").unlink()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return out


def _dequantized(folder: Path):  # noqa: ANN202
    """transformers' model of an MXFP4 checkpoint, its experts dequantized (exactly, to bf16)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=tf.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    )
    return model.eval()


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """The tiny checkpoint (plain or peaked), built once per module."""
    cache: dict[bool, tuple] = {}

    def get(peaked: bool = False):  # noqa: ANN202
        if peaked not in cache:
            folder = tmp_path_factory.mktemp("gpt-oss")
            model, tok = build(folder, peaked=peaked)
            cache[peaked] = (folder, model, tok)
        return cache[peaked]

    return get


def _router_margin(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """Per position, the smallest gap (over layers) between the last chosen expert's router logit
    and the next one's: how near the routing is to taking another expert."""
    import torch

    with torch.no_grad():
        out = model.float()(torch.tensor([ids]), output_router_logits=True)
    gaps = []
    for r in out.router_logits:
        top = r.float().topk(N_USED + 1, dim=-1).values.numpy()
        gaps.append(top[:, N_USED - 1] - top[:, N_USED])
    return np.min(gaps, axis=0)


@pytest.fixture(scope="module")
def f16(gpt_oss, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    """The plain checkpoint converted to F16 once, and its reader (a reader of a Qwen3-vocabulary
    file takes seconds)."""
    folder, _, _ = gpt_oss()
    path = convert.convert(folder, tmp_path_factory.mktemp("gpt-oss-f16") / "m.gguf", outtype="f16").path
    return path, gguf_reader(path)


@pytest.fixture(scope="module")
def layered(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """Once: a peaked checkpoint calibrated so that its layers decide LAYER_SHARE of the top-1s
    (make_layered), its F16 file, the ids, transformers' top-1s and the share. A model of its own:
    the MXFP4 tests keep the peaked one as it is."""
    folder = tmp_path_factory.mktemp("gpt-oss-layered")
    ids, top1, share = save_layered(folder, *build(folder, peaked=True))
    out = tmp_path_factory.mktemp("gpt-oss-layered-f16") / "m.gguf"
    return convert.convert(folder, out, outtype="f16", name="tiny").path, ids, top1, share


def test_f32_logits_and_greedy_match_transformers(gpt_oss, tmp_path: Path) -> None:  # noqa: ANN001
    folder, model, tok = gpt_oss()
    ids = logit_ids(tok)
    assert len(ids) > 20 * WINDOW  # the sliding layer's window matters at most positions
    ref, routes = logits_and_routes(model, ids, N_USED)
    assert len(routes) == 2  # one per layer
    for layer in routes:
        _, counts = np.unique(layer, axis=0, return_counts=True)
        assert counts.max() <= len(ids) * 2 / 3, "most positions route to the same experts"
        assert len(set(layer.ravel().tolist())) >= N_EXPERT - 2, "most experts are never used"
    res = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny")
    prompt = ids[:12]
    want = greedy(model, prompt, 24)
    got = llama_probe(res.path, logits=[ids], generate={"ids": prompt, "n": 24})
    assert_logits_close(got["logits0"], ref)
    assert list(got["generated"]) == want
    assert len(set(want)) > 3
    shapes = {t.name: t.shape for t in res.plan.tensors}
    assert shapes["blk.1.ffn_gate_exps.weight"] == (N_EXPERT, N_FF, HIDDEN)
    assert shapes["blk.1.ffn_up_exps.bias"] == (N_EXPERT, N_FF)
    assert shapes["blk.1.ffn_down_exps.weight"] == (N_EXPERT, HIDDEN, N_FF)
    assert shapes["blk.0.attn_sinks.weight"] == (4,)


def test_f16_top1_agrees(layered) -> None:  # noqa: ANN001
    out, ids, top1, share = layered
    assert share >= LAYER_SHARE, "the layers must decide a good share of the predictions"
    assert (top1 != np.asarray(ids)).mean() >= 0.03, "the layers must decide some predictions"
    agreement = top1_agreement(out, ids, top1)
    assert agreement >= 0.99
    assert agreement >= AGREEMENT["f16"]


def test_broken_layer_fails_the_agreement_check(layered, tmp_path: Path) -> None:  # noqa: ANN001
    out, ids, top1, _ = layered
    broken = tmp_path / "broken.gguf"
    name = break_last_layer(out, broken)
    assert top1_agreement(broken, ids, top1) < AGREEMENT["f16"], f"{name} reversed went unseen"


def test_metadata(f16) -> None:  # noqa: ANN001
    _, r = f16
    kv = {k: f.contents() for k, f in r.fields.items()}
    assert kv["general.architecture"] == "gpt-oss"
    assert kv["gpt-oss.expert_count"] == N_EXPERT
    assert kv["gpt-oss.expert_used_count"] == N_USED
    assert kv["gpt-oss.expert_feed_forward_length"] == N_FF
    assert kv["gpt-oss.attention.sliding_window"] == WINDOW
    assert kv["gpt-oss.rope.scaling.type"] == "yarn"
    assert kv["gpt-oss.rope.scaling.factor"] == 32.0
    assert kv["gpt-oss.rope.scaling.original_context_length"] == 4096


def test_from_module_matches_folder_conversion(gpt_oss, f16, tmp_path: Path) -> None:  # noqa: ANN001
    _, model, tok = gpt_oss()
    a = convert.from_module(model, tok, tmp_path / "mem.gguf", outtype="f16", name="m").path
    _, disk = f16  # the folder's conversion (its name is metadata, not a tensor)
    assert gguf_tensors(gguf_reader(a)) == gguf_tensors(disk)


def test_layer_pattern_llama_cpp_cannot_run_is_refused(gpt_oss, tmp_path: Path) -> None:  # noqa: ANN001
    src, _, _ = gpt_oss()
    folder = tmp_path / "g"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["full_attention", "sliding_attention"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="layer_types"):
        convert.convert(folder, dry_run=True)


@pytest.mark.slow
def test_same_file_as_llama_cpp_converter(
    gpt_oss, f16, llama_cpp_converter: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    src, _, _ = gpt_oss()
    ref = reference_gguf(llama_cpp_converter, src, tmp_path / "ref.gguf", "f16")
    _, ours = f16  # convert.convert(src, outtype="f16")
    assert gguf_tensors(ours) == gguf_tensors(ref)  # names, types, shapes and bytes
    assert model_keys(ours) == model_keys(ref)


# --- MXFP4 experts (the published checkpoints) ---------------------------------------------------


@pytest.fixture(scope="module")
def mxfp4_checkpoint(gpt_oss, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN001, ANN201
    src, _, tok = gpt_oss(peaked=True)
    folder = tmp_path_factory.mktemp("gpt-oss-mxfp4") / "m"
    return folder, build_mxfp4(src, folder), tok


def test_mxfp4_repack_keeps_the_source_bytes_and_values(mxfp4_checkpoint) -> None:  # noqa: ANN001
    import gguf
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, quantized, _ = mxfp4_checkpoint
    names = [k for k in quantized if k.endswith("_blocks")]
    assert len(names) == 4  # gate_up and down of each of the 2 layers
    for name in names:
        blocks, scales = quantized[name], quantized[name.replace("_blocks", "_scales")]
        packed = mxfp4_repack(blocks, scales)
        assert packed.shape == (*scales.shape[:-1], scales.shape[-1] * 17)
        # Scale bytes as they were; the nibbles only moved (element j of a block: byte j % 16,
        # low nibble for j < 16), so undoing that gives the source blocks back byte for byte.
        per_block = packed.reshape(*scales.shape, 17)
        assert np.array_equal(per_block[..., 0], scales)
        qs = per_block[..., 1:]
        elements = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)
        assert np.array_equal(elements[..., 0::2] | (elements[..., 1::2] << 4), blocks)
        # And llama.cpp reads the values that transformers dequantizes.
        want = convert_moe_packed_tensors(
            torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
        ).numpy()
        rows = packed.reshape(-1, packed.shape[-1])
        got = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
        assert np.array_equal(got.reshape(*blocks.shape[:-2], -1).swapaxes(-1, -2), want)


def test_mxfp4_experts_stay_mxfp4(mxfp4_checkpoint, tmp_path: Path) -> None:  # noqa: ANN001
    folder, quantized, tok = mxfp4_checkpoint
    out = convert.convert(folder, tmp_path / "m.gguf", outtype="f32", name="tiny").path
    tensors = gguf_tensors(out)
    for bid in range(2):
        pre = f"model.layers.{bid}.mlp.experts"
        gate_up = (quantized[f"{pre}.gate_up_proj_blocks"], quantized[f"{pre}.gate_up_proj_scales"])
        down = (quantized[f"{pre}.down_proj_blocks"], quantized[f"{pre}.down_proj_scales"])
        # gate and up rows interleave in the source, as in transformers' 16-bit layout
        for kind, (b, sc) in {
            "gate": (gate_up[0][:, 0::2], gate_up[1][:, 0::2]),
            "up": (gate_up[0][:, 1::2], gate_up[1][:, 1::2]),
            "down": down,
        }.items():
            tensor_type, _, data = tensors[f"blk.{bid}.ffn_{kind}_exps.weight"]
            assert tensor_type == GGMLQuantizationType.MXFP4
            assert data == mxfp4_repack(b, sc).tobytes()
    ids = logit_ids(tok)
    model = _dequantized(folder)
    ref, _ = logits_and_routes(model, ids, N_USED)
    top1 = ref.argmax(-1)
    assert (top1 != np.asarray(ids)).mean() >= 0.03, "the layers must decide some predictions"
    # llama.cpp multiplies MXFP4 weights by activations rounded to 8 bits (Q8_0), coarser than
    # F16: near-ties may flip, and where the router nearly ties a position may take another expert
    got = llama_probe(out, logits=[ids])["logits0"]
    assert (got.argmax(-1) == top1).mean() >= 0.97
    clear = _router_margin(model, ids) > 0.02
    assert clear.mean() >= 0.8  # most positions are checked
    diff = np.abs(got - ref).max(-1)[clear]
    assert float(diff.max()) < 1e-2 * float(ref.max() - ref.min())


_LLAMA_CPP_REPACK = """
import sys, types
import numpy as np, torch
sys.path[:0] = [sys.argv[1] + "/gguf-py", sys.argv[1]]
from conversion.gpt_oss import GptOssModel
data = dict(np.load(sys.argv[2]))
out = {}
writer = types.SimpleNamespace(add_tensor=lambda name, a, raw_dtype: out.__setitem__(name, a))
model = types.SimpleNamespace(gguf_writer=writer)
model.transform_nibble_layout = lambda t: GptOssModel.transform_nibble_layout(model, t)
for name in [k for k in data if k.endswith("_blocks")]:
    b = torch.from_numpy(data[name])
    s = torch.from_numpy(data[name.replace("_blocks", "_scales")])
    if "gate_up" in name:  # as its generate_extra_tensors splits them
        GptOssModel.repack_mxfp4(model, name + ".gate", b[:, ::2], s[:, ::2])
        GptOssModel.repack_mxfp4(model, name + ".up", b[:, 1::2], s[:, 1::2])
    else:
        GptOssModel.repack_mxfp4(model, name, b, s)
np.savez(sys.argv[3], **out)
"""


@pytest.mark.slow
def test_mxfp4_repack_same_bytes_as_llama_cpp_converter(
    mxfp4_checkpoint, llama_cpp_converter: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    _, quantized, _ = mxfp4_checkpoint
    np.savez(tmp_path / "in.npz", **quantized)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _LLAMA_CPP_REPACK,
            str(llama_cpp_converter),
            str(tmp_path / "in.npz"),
            str(tmp_path / "out.npz"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with np.load(tmp_path / "out.npz") as ref:
        assert len(ref.files) == 6  # gate, up and down of each layer
        for name in ref.files:
            blocks_name = name.removesuffix(".gate").removesuffix(".up")
            b, sc = quantized[blocks_name], quantized[blocks_name.replace("_blocks", "_scales")]
            if name.endswith(".gate"):
                b, sc = b[:, 0::2], sc[:, 0::2]
            elif name.endswith(".up"):
                b, sc = b[:, 1::2], sc[:, 1::2]
            assert np.array_equal(mxfp4_repack(b, sc), ref[name]), name


@pytest.mark.slow
def test_mxfp4_same_file_as_llama_cpp_converter(
    gpt_oss, llama_cpp_converter: Path, tmp_path: Path
) -> None:  # noqa: ANN001
    # untied embeddings, as published (llama.cpp's converter writes no output.weight if tied)
    folder = tmp_path / "m"
    build_mxfp4(gpt_oss()[0], folder)
    ours = gguf_reader(convert.convert(folder, tmp_path / "ours.gguf", outtype="f16").path)
    ref = reference_gguf(llama_cpp_converter, folder, tmp_path / "ref.gguf", "f16")
    assert gguf_tensors(ours) == gguf_tensors(ref)  # the MXFP4 experts' bytes included
    assert model_keys(ours) == model_keys(ref)
