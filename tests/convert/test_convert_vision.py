"""Vision-language checkpoints to a text GGUF and a projector GGUF (mmproj) in one conversion,
against llama.cpp's own convert_hf_to_gguf.py (text) and its --mmproj (projector) on the same
checkpoint: the same tensors (names, order, shapes, types, bytes) and metadata, for Qwen2-VL,
Qwen2.5-VL, Gemma 3, Idefics3 / SmolVLM, LLaVA with a Pixtral tower and Mistral 3; and the same
greedy reply to an image when llama.cpp runs Qwen2-VL's files, and as transformers gives it when
llama.cpp runs ours of LLaVA-Pixtral, Mistral 3 and Ministral 3. LLaVA 1.5 (a CLIP tower), whose projector
llama.cpp's converter does not write, against llama.cpp's own LLaVA scripts.

Metadata that differs by design: general.name (llama.cpp's converter makes a display name of the
folder name, "Qwen2 VL Tiny"; ours is the folder name, as for every text model), and the
vocabulary's own keys that the tokenizer tests own (tokenizer.ggml.eot_token_id, add_space_prefix
and remove_extra_whitespaces, which ours writes, and add_bos/add_eos_token False, which ours leaves
implicit); GGUF.* counts follow from the rest. Gemma 3's test names two more keys, and the Pixtral
one a tensor that ours writes and llama.cpp's converter leaves out.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
from convert_helpers import (
    _tokenizer,
    converter_cache,
    gguf_reader,
    gguf_tensors,
    llama_cpp_converter_dir,
    need_asset,
)

import convert
from convert.archs import llava_clip
from localrun import api
from localrun.backends import llama_vision
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from tests.conftest import run_cli
from tests.vision_models import (
    CLIP_MEAN,
    CLIP_SIDE,
    CLIP_STD,
    clear_margins,
    gemma3_config,
    llava15_checkpoint,
    qwen2vl,
    test_image,
)

Q = gguf.GGMLQuantizationType
PROMPT = "Describe this image."
# Keys ours writes that llama.cpp's converter leaves out (the vocabulary's, see the docstring).
OURS_ONLY = {
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.remove_extra_whitespaces",
}
IMPLICIT_FALSE = {"tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token"}


def _read(path: Path) -> tuple[dict[str, Any], dict[str, tuple]]:
    """A file's metadata (but GGUF.* and general.name) and its tensors (type, shape, bytes), read once
    (parsing a 151k-token vocabulary takes seconds)."""
    r = gguf_reader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k != "general.name"}
    return fields, gguf_tensors(r)


def assert_same_file(ours: Path, ref: Path, ours_only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Tensors equal in name, order, type, shape and bytes (but the ours_only ones, which ours has
    and the reference lacks); metadata equal but for the keys above.
    Returns our file's metadata, with each tensor's type as "tensor:NAME"."""
    (got, got_t), (want, want_t) = _read(ours), _read(ref)
    types = {f"tensor:{name}": Q(t[0]) for name, t in got_t.items()}
    for name in ours_only:
        assert name in got_t and name not in want_t, name
        del got_t[name]
    assert list(got_t) == list(want_t)
    for name, (qtype, shape, data) in want_t.items():
        assert got_t[name][:2] == (qtype, shape), name
        assert got_t[name][2] == data, name  # bit-exact
    for key in IMPLICIT_FALSE:
        if want.get(key) is False and key not in got:
            del want[key]
    assert {k: got.get(k) for k in want} == want
    assert set(got) - set(want) <= OURS_ONLY
    return {**got, **types}


def _linked(src: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    """A folder of links to src's files (the cached checkpoint stays untouched)."""
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name not in skip:
            (folder / f.name).symlink_to(f)
    return folder


@pytest.fixture(scope="module")
def ours_f32(tmp_path_factory: pytest.TempPathFactory) -> convert.Result:
    """localrun's conversion of the tiny Qwen2-VL at F32: the model and its projector."""
    out = tmp_path_factory.mktemp("qwen2vl") / "qwen2vl-tiny-f32.gguf"
    return convert.convert(qwen2vl("f32").hf, out, outtype="f32")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_qwen2vl_files_equal_llama_cpps(dtype: str, ours_f32: convert.Result, tmp_path: Path) -> None:
    ref = qwen2vl(dtype)
    res = ours_f32 if dtype == "f32" else convert.convert(ref.hf, tmp_path / "m.gguf", outtype=dtype)
    assert res.mmproj is not None and res.mmproj.path == res.path.with_name(f"mmproj-{res.path.name}")
    text = assert_same_file(res.path, ref.gguf)
    projector = assert_same_file(res.mmproj.path, ref.mmproj)
    # what the equality covers, spelled out for Qwen2-VL
    assert text["general.architecture"] == "qwen2vl" and text["qwen2vl.rope.dimension_sections"] == [2, 3, 3, 0]
    assert projector["general.architecture"] == "clip" and projector["general.type"] == "mmproj"
    assert projector["clip.projector_type"] == "qwen2vl_merger"
    assert projector["clip.vision.patch_size"] == 14 and projector["clip.vision.image_size"] == 560
    assert projector["clip.vision.image_mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])
    for name in ("v.patch_embd.weight", "v.patch_embd.weight.1", "v.blk.2.attn_q.weight", "mm.0.weight"):
        assert projector[f"tensor:{name}"] == (Q.F32 if dtype == "f32" else Q.F16), name
    assert not any(k.startswith(("tensor:token_embd", "tensor:blk.")) for k in projector)
    assert not any(k.startswith(("tensor:v.", "tensor:mm.")) for k in text)


def _reply(model: Path, mmproj: Path, image: Path) -> str:
    session = api.load(api.get_model(str(model)), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(mmproj)))
    try:
        chunks = api.stream(session, Request.chat([{"role": "user", "content": PROMPT,
                                                    "images": [image.read_bytes()]}]),
                            GenerationParams(temperature=0, max_tokens=8))
        return "".join(c.text for c in chunks)
    finally:
        session.close()


def test_converted_files_reply_to_an_image_as_llama_cpps_do(ours_f32: convert.Result, tmp_path: Path) -> None:
    ref = qwen2vl("f32")
    assert ours_f32.mmproj is not None
    replies = []
    for seed in (0, 1):
        image = test_image(tmp_path / f"image{seed}.png", seed=seed)
        ours = _reply(ours_f32.path, ours_f32.mmproj.path, image)
        assert ours == _reply(ref.gguf, ref.mmproj, image)
        replies.append(ours)
    assert replies[0] != replies[1]  # the reply depends on the image: the projector is in use


def test_cli_writes_both_registers_the_projector_and_keeps_it_f16_when_quantizing(tmp_path: Path) -> None:
    ref = qwen2vl("f16")
    folder = _linked(ref.hf, tmp_path / "Qwen2-VL-tiny")
    res = run_cli("convert", str(folder), "--outtype", "q4_k_m")
    assert res.returncode == 0, res.stderr
    model, projector = folder / "Qwen2-VL-tiny-Q4_K_M.gguf", folder / "mmproj-Qwen2-VL-tiny-F16.gguf"
    assert res.stdout.splitlines() == [str(model), str(projector)]
    assert f"wrote the projector {projector}" in res.stderr
    assert gguf_reader(model).fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert_same_file(projector, ref.mmproj)  # llama.cpp's F16 projector, byte for byte
    info = api.get_model("qwen2-vl-tiny:q4_k_m")
    assert Path(info.path) == model and info.details["mmproj"] == str(projector.resolve())
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temporary left


def test_api_convert_model_registers_the_model_with_its_projector(tmp_path: Path) -> None:
    folder = _linked(qwen2vl("f32").hf, tmp_path / "ckpt")
    info = api.convert_model(folder, tmp_path / "vl-Q8_0.gguf", outtype="q8_0", name="vl:q8")
    projector = tmp_path / "mmproj-vl-F16.gguf"
    assert info.name == "vl:q8" and info.details["mmproj"] == str(projector.resolve())
    assert {t.tensor_type for t in gguf_reader(projector).tensors} == {Q.F16, Q.F32}


def test_cli_dry_run_shows_both_plans_and_mmproj_outtype(tmp_path: Path) -> None:
    folder = _linked(qwen2vl("f32").hf, tmp_path / "ckpt")
    out = tmp_path / "vl-F16.gguf"
    res = run_cli("convert", str(folder), "-o", str(out), "--outtype", "f16", "--mmproj-outtype", "f32",
                  "--dry-run")
    assert res.returncode == 0, res.stderr
    text, _, projector = res.stdout.partition("\nprojector:\n")
    assert "architecture: qwen2vl" in text and "token_embd.weight" in text
    assert "architecture: clip" in projector and f"output: {tmp_path / 'mmproj-vl-F32.gguf'}" in projector
    assert "v.patch_embd.weight.1" in projector and "F16" not in projector  # all F32, as asked
    assert list(tmp_path.glob("*.gguf")) == []


def _qwen25vl(folder: Path) -> Path:
    """A tiny random Qwen2.5-VL (BF16, tied embeddings, 4 vision blocks with full attention in
    every second one) with the Llama 2 SentencePiece tokenizer and an image processor config."""
    import torch
    import transformers as tf

    config = tf.Qwen2_5_VLConfig(
        text_config={
            "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 64,
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
            "fullatt_block_indexes": [1, 3], "in_channels": 3,
        },
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    tf.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder)
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "preprocessor_config.json").write_text(
        json.dumps({"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "patch_size": 14}))
    return folder


def _reference(hf: Path, out: Path, outtype: str, mmproj: bool = False) -> Path:
    converter = llama_cpp_converter_dir(converter_cache()) / "convert_hf_to_gguf.py"
    command = [sys.executable, str(converter), str(hf), "--outtype", outtype, "--outfile", str(out)]
    proc = subprocess.run(command + (["--mmproj"] if mmproj else []), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


@pytest.mark.slow  # three runs of llama.cpp's converter
def test_qwen25vl_and_a_q8_0_projector_equal_llama_cpps(tmp_path: Path) -> None:
    """Qwen2.5-VL (qwen2.5vl_merger: gated SiLU MLPs, RMS norms, windowed attention) from BF16, and a
    projector written as Q8_0 (its patch embeddings F32, as llama.cpp's converter keeps them)."""
    hf = _qwen25vl(tmp_path / "qwen25")
    res = convert.convert(hf, tmp_path / "m.gguf", outtype="f16")
    assert res.mmproj is not None
    assert_same_file(res.path, _reference(hf, tmp_path / "ref.gguf", "f16"))
    projector = assert_same_file(res.mmproj.path, _reference(hf, tmp_path / "ref-mmproj.gguf", "f16", mmproj=True))
    assert projector["clip.projector_type"] == "qwen2.5vl_merger"
    assert projector["clip.use_silu"] is True and projector["clip.vision.n_wa_pattern"] == 2
    q8 = convert.convert(hf, tmp_path / "q.gguf", outtype="f16", mmproj_outtype="q8_0").mmproj
    assert q8 is not None and q8.path.name == "mmproj-q.gguf"
    types = assert_same_file(q8.path, _reference(hf, tmp_path / "ref-mmproj-q8.gguf", "q8_0", mmproj=True))
    assert types["tensor:v.blk.0.ffn_gate.weight"] == Q.Q8_0 and types["tensor:v.patch_embd.weight.1"] == Q.F32


def _gemma3(folder: Path) -> Path:
    """A tiny random Gemma 3 with images (SigLIP: 3 layers, 56x56 pixels in 4x4 patches pooled to 2x2
    image tokens) with the Llama 2 SentencePiece tokenizer, saved by transformers: the vision tower's
    tensors as vision_tower.embeddings..., without the published layout's vision_model."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(gemma3_config(32000, boi=3, eoi=4, image=5))
    with torch.no_grad():  # not the initial ones: a norm left out or not shifted by 1 would show
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.uniform_(-0.5, 0.5)
    model.save_pretrained(folder)
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_seq_length": 4}))
    return folder


def _published_layout(src: Path, folder: Path) -> Path:
    """src with its vision tower's tensors renamed as the published Gemma 3 checkpoints have them."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, folder)
    tensors = load_file(src / "model.safetensors")
    tower = "vision_tower."
    save_file({f"{tower}vision_model.{k[len(tower):]}" if k.startswith(tower) else k: v
               for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.slow  # two runs of llama.cpp's converter
def test_gemma3_files_equal_llama_cpps_from_either_layout(tmp_path: Path) -> None:
    """Gemma 3's projector (gemma3: SigLIP, the soft-embedding norm shifted by 1, the projection in
    F16 and the embeddings in F32 whatever the type) from the published layout, which llama.cpp's
    converter reads, and from transformers 5's, which it does not: the same files.

    Two text keys differ from llama.cpp's converter by the text conversion's own choices: the
    sliding-window pattern, which ours writes from layer_types, and add_space_prefix, which ours
    reads from the tokenizer (True in the borrowed Llama 2 tokenizer, False in Gemma 3's own) and
    llama.cpp's converter sets False for Gemma 3."""
    saved = _gemma3(tmp_path / "saved")
    published = _published_layout(saved, tmp_path / "published")
    ref_text = _reference(published, tmp_path / "ref.gguf", "f16")
    ref_projector = _reference(published, tmp_path / "ref-mmproj.gguf", "f16", mmproj=True)
    for hf in (published, saved):
        res = convert.convert(hf, tmp_path / f"{hf.name}.gguf", outtype="f16")
        assert res.mmproj is not None
        projector = assert_same_file(res.mmproj.path, ref_projector)
        got, got_t = _read(res.path)
        want, want_t = _read(ref_text)
        assert got_t == want_t
        assert got.pop("gemma3.attention.sliding_window_pattern") == [True, False]
        assert (got.pop("tokenizer.ggml.add_space_prefix"), want.pop("tokenizer.ggml.add_space_prefix")) == (
            True, False)
        assert {k: got.get(k) for k in want} == want and set(got) - set(want) <= OURS_ONLY
    assert projector["clip.projector_type"] == "gemma3" and projector["clip.vision.projector.scale_factor"] == 2
    assert projector["tensor:mm.input_projection.weight"] == Q.F16
    assert projector["tensor:v.patch_embd.weight"] == projector["tensor:v.position_embd.weight"] == Q.F32


def _idefics3(folder: Path) -> Path:
    """A tiny random Idefics3 / SmolVLM (a Llama text model; SigLIP: 3 layers, 56x56 pixels, pixel
    shuffle 2) with the Llama 2 SentencePiece tokenizer; text_config names its architecture as the
    published configs do (llama.cpp's converter reads the text model's class there)."""
    import torch
    import transformers as tf

    config = tf.Idefics3Config(
        text_config={
            "model_type": "llama", "vocab_size": 32000, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
            "image_size": 56, "patch_size": 14, "num_channels": 3,
        },
        scale_factor=2, image_token_id=5,
    )
    torch.manual_seed(0)
    tf.Idefics3ForConditionalGeneration(config).save_pretrained(folder)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    saved["text_config"]["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(saved))
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "size": {"longest_edge": 112}}))
    return folder


@pytest.mark.slow  # two runs of llama.cpp's converter
def test_smolvlm_files_equal_llama_cpps(tmp_path: Path) -> None:
    """Idefics3 / SmolVLM: the Llama text model (its Q/K rows permuted) and the idefics3 projector
    (the embeddings in F32, the pixel shuffle's factor and the image processor's longest side)."""
    hf = _idefics3(tmp_path / "smolvlm")
    res = convert.convert(hf, tmp_path / "m.gguf", outtype="f16")
    assert res.mmproj is not None
    text = assert_same_file(res.path, _reference(hf, tmp_path / "ref.gguf", "f16"))
    projector = assert_same_file(res.mmproj.path, _reference(hf, tmp_path / "ref-mmproj.gguf", "f16", mmproj=True))
    assert text["general.architecture"] == "llama" and projector["clip.projector_type"] == "idefics3"
    assert projector["clip.vision.projector.scale_factor"] == 2
    assert projector["clip.vision.preproc_image_size"] == 112
    assert projector["tensor:v.patch_embd.weight"] == Q.F32 and projector["tensor:mm.model.fc.weight"] == Q.F16


# LLaVA with a Pixtral tower and Mistral 3: the Llama 2 vocabulary with the image tokens after it
IMAGE_TOKENS = {"[IMG]": 32000, "[IMG_BREAK]": 32001, "[IMG_END]": 32002}
PIXTRAL_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the image, then the text
WIDTH, HEIGHT = 128, 64  # whole patches (16) and merged patches (32), above mtmd's 8-token minimum: not resized


@dataclass(frozen=True)
class PixtralFamily:
    """One tiny checkpoint, transformers' model and processor of it, and our F32 conversion."""

    family: str  # "llava", "mistral3" or "ministral3"
    hf: Path
    model: Any
    processor: Any
    ours: convert.Result


def _pixtral_checkpoint(folder: Path, family: str) -> tuple[Any, Any]:
    """A tiny random LLaVA with a Pixtral tower (Pixtral 12B's layout: every patch of the last layer,
    projector biases) or Mistral 3 (no biases, a 2x2 patch merger), on a Mistral text model, saved
    with the Llama 2 SentencePiece tokenizer and the image tokens in tokenizer_config.json.

    Weights: unit-scale embeddings and output rows, the output projections tripled, so that the
    greedy reply depends on the image and its top-1 margins stay far above F32 rounding."""
    import torch
    import transformers as tf
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    text = {
        "model_type": "ministral3" if family == "ministral3" else "mistral", "vocab_size": 32003, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    }
    if family == "ministral3":  # Ministral 3's YaRN (its published settings) and Llama 4's query scaling
        text["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
        text["max_position_embeddings"] = 262144
    # 3 blocks: gguf's tensor map knows the projector's linear_2 (mm.2) only for more than 2
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
              "num_attention_heads": 2, "head_dim": 16, "image_size": WIDTH, "patch_size": 16, "hidden_act": "silu"}
    common = {"text_config": text, "vision_config": vision, "image_token_index": IMAGE_TOKENS["[IMG]"],
              "vision_feature_layer": -1}
    merge = 1
    torch.manual_seed(0)
    if family == "llava":
        model = tf.LlavaForConditionalGeneration(tf.LlavaConfig(**common, vision_feature_select_strategy="full"))
    else:
        merge = 2
        model = tf.Mistral3ForConditionalGeneration(
            tf.Mistral3Config(**common, spatial_merge_size=merge, multimodal_projector_bias=False))
    clear_margins(model, seed=5)
    model.eval().save_pretrained(folder)
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in IMAGE_TOKENS.items()}}))
    # Mistral 3's processor aligns images to the merged patch, as mtmd does
    processor = PixtralImageProcessorPil(size={"longest_edge": WIDTH}, patch_size=16 * merge,
                                         image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
    processor.save_pretrained(folder)
    return model, processor


@pytest.fixture(scope="module", params=["llava", "mistral3", "ministral3"])
def pixtral(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> PixtralFamily:
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    model, processor = _pixtral_checkpoint(folder / "ckpt", family)
    ours = convert.convert(folder / "ckpt", folder / f"{family}-f32.gguf", outtype="f32")
    return PixtralFamily(family, folder / "ckpt", model, processor, ours)


@pytest.mark.slow  # four runs of llama.cpp's converter per family
def test_pixtral_files_equal_llama_cpps_but_for_the_img_break_row(pixtral: PixtralFamily, tmp_path: Path) -> None:
    """LLaVA-Pixtral (text: llama) and Mistral 3 (text: mistral3; projector: the patch merger): F32
    files, and F16 ones with an F16 (Mistral 3) or Q8_0 (LLaVA) projector, equal llama.cpp's.

    One tensor differs by design: v.token_embd.img_break, the [IMG_BREAK] token's embedding, which
    mtmd puts after each row of patches and refuses to load a pixtral projector without. llama.cpp's
    converter means to copy it from the text embeddings but drops every language_model tensor before
    it looks (llama.cpp issue 24235); ours writes it where that copy would come, first."""
    from safetensors.numpy import load_file

    hf, ours = pixtral.hf, pixtral.ours
    mmproj_type = "q8_0" if pixtral.family == "llava" else "f16"
    jobs = [("ref.gguf", "f32", False), ("ref-mmproj.gguf", "f32", True), ("ref-f16.gguf", "f16", False),
            (f"ref-mmproj-{mmproj_type}.gguf", mmproj_type, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each run is a process of its own
        refs = list(pool.map(lambda job: _reference(hf, tmp_path / job[0], job[1], mmproj=job[2]), jobs))
    assert ours.mmproj is not None
    text = assert_same_file(ours.path, refs[0])
    projector = assert_same_file(ours.mmproj.path, refs[1], ours_only=("v.token_embd.img_break",))
    (first, *_), reader = gguf_tensors(ours.mmproj.path), gguf_reader(ours.mmproj.path)
    row = load_file(hf / "model.safetensors")["language_model.model.embed_tokens.weight"][IMAGE_TOKENS["[IMG_BREAK]"]]
    assert first == "v.token_embd.img_break" and bytes(reader.tensors[0].data) == row.tobytes()
    assert projector["clip.projector_type"] == "pixtral" and projector["clip.use_silu"] is True
    assert projector["clip.vision.patch_size"] == 16 and projector["clip.vision.image_size"] == WIDTH
    if pixtral.family == "llava":
        assert text["general.architecture"] == "llama" and "clip.vision.spatial_merge_size" not in projector
        assert projector["tensor:mm.1.bias"] == Q.F32
    else:
        assert text["general.architecture"] == "mistral3" and projector["clip.vision.spatial_merge_size"] == 2
        if pixtral.family == "ministral3":
            assert text["mistral3.rope.scaling.type"] == "yarn" and text["mistral3.rope.scaling.factor"] == 16
            assert text["mistral3.attention.temperature_scale"] == pytest.approx(0.1)
        assert projector["tensor:mm.patch_merger.weight"] == Q.F32
    res = convert.convert(hf, tmp_path / "m.gguf", outtype="f16", mmproj_outtype=mmproj_type)
    assert res.mmproj is not None
    assert_same_file(res.path, refs[2])
    types = assert_same_file(res.mmproj.path, refs[3], ours_only=("v.token_embd.img_break",))
    assert types["tensor:v.token_embd.img_break"] == Q.F32
    if pixtral.family == "llava":  # a Q8_0 projector keeps its patch embeddings in F32
        assert types["tensor:v.blk.0.attn_q.weight"] == Q.Q8_0 and types["tensor:v.patch_embd.weight"] == Q.F32
    else:  # an F16 one has its patch embeddings and merger in F16, as llama.cpp's converter forces them
        assert types["tensor:v.patch_embd.weight"] == types["tensor:mm.patch_merger.weight"] == Q.F16


@pytest.mark.parametrize("pixtral", ["ministral3"], indirect=True)
def test_ministral3_text_model_alone_equals_llama_cpps(pixtral: PixtralFamily, tmp_path: Path) -> None:
    """Ministral3ForCausalLM, the text half of Ministral 3 saved alone: llama.cpp's mistral3
    architecture with the YaRN log multiplier and Llama 4's query scaling."""
    import transformers as tf

    tied = pixtral.model.config.tie_word_embeddings  # as the vision-language model: one matrix in and out
    text = tf.Ministral3ForCausalLM(
        tf.Ministral3Config(**{**pixtral.model.config.text_config.to_dict(), "tie_word_embeddings": tied}))
    text.model.load_state_dict(pixtral.model.model.language_model.state_dict())
    text.lm_head.load_state_dict(pixtral.model.lm_head.state_dict())
    folder = tmp_path / "Ministral3-text"
    text.eval().save_pretrained(folder)
    shutil.copy(pixtral.hf / "tokenizer.model", folder)
    shutil.copy(pixtral.hf / "tokenizer_config.json", folder)
    ours = convert.convert(folder, tmp_path / "m.gguf", outtype="f32")
    assert ours.mmproj is None
    keys = assert_same_file(ours.path, _reference(folder, tmp_path / "ref.gguf", "f32"))
    assert keys["general.architecture"] == "mistral3" and keys["mistral3.rope.scaling.yarn_log_multiplier"] == 1.0
    assert gguf_tensors(ours.path) == gguf_tensors(pixtral.ours.path)  # the vision-language file's text model


def _engine_reply(ours: convert.Result, image: Path, n: int = 8) -> tuple[list[bytes], dict[str, Any]]:
    """The llama.cpp engine's greedy reply (each token's bytes) to PIXTRAL_TEMPLATE's prompt, the
    image then PROMPT, with our converted pair loaded; and the session's info."""
    assert ours.mmproj is not None
    session = api.load(api.get_model(str(ours.path)), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(ours.mmproj.path)))
    try:
        request = dataclasses.replace(
            Request.chat([{"role": "user", "content": PROMPT, "images": [image.read_bytes()]}]), template=PIXTRAL_TEMPLATE)
        chunks = list(api.stream(session, request, GenerationParams(temperature=0, max_tokens=n, logprobs=0)))
        return [bytes(lp.bytes) for c in chunks for lp in c.logprobs], session.info()
    finally:
        session.close()


def _hf_greedy(pixtral: PixtralFamily, image: Path, n: int) -> list[bytes]:
    """transformers' greedy reply (F32) to what mtmd makes of PIXTRAL_TEMPLATE's prompt: BOS, each row
    of image patches followed by [IMG_BREAK], the last one by [IMG_END], then the text; each token
    as its bytes."""
    import torch
    from PIL import Image

    tok = _tokenizer("llama2-spm")
    with Image.open(image) as file:
        batch = pixtral.processor(images=[file.convert("RGB")], return_tensors="pt")
    side = 16 * (1 if pixtral.family == "llava" else 2)
    rows = [[IMAGE_TOKENS["[IMG]"]] * (WIDTH // side) + [IMAGE_TOKENS["[IMG_BREAK]"]] for _ in range(HEIGHT // side)]
    rows[-1][-1] = IMAGE_TOKENS["[IMG_END]"]
    ids = torch.tensor([[tok.bos_token_id, *(t for row in rows for t in row),
                         *tok.encode(PROMPT, add_special_tokens=False)]])
    with torch.no_grad():
        out = pixtral.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                     do_sample=False, **batch)
    pieces = tok.convert_ids_to_tokens(out[0, ids.shape[1]:].tolist())
    return [bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("\u2581", " ").encode() for p in pieces]


def test_pixtral_files_reply_to_an_image_as_transformers_does(pixtral: PixtralFamily, tmp_path: Path) -> None:
    """llama.cpp's runtime loads our pair (the projector with its [IMG_BREAK] row) and its greedy reply
    is transformers', token for token, on the same pixels; another image, another reply."""
    ours = pixtral.ours
    assert ours.mmproj is not None
    replies = []
    for seed in (0, 1):
        image = test_image(tmp_path / f"image{seed}.png", WIDTH, HEIGHT, seed=seed)
        got, _ = _engine_reply(ours, image)
        assert got == _hf_greedy(pixtral, image, 8)
        replies.append(got)
    assert replies[0] != replies[1]  # the reply depends on the image: the projector is in use


# LLaVA 1.5 (llava-hf): a CLIP tower read at its last-but-one layer without [CLS], an MLP projector


@dataclass(frozen=True)
class ClipLlava:
    hf: Path
    model: Any
    ours: convert.Result  # F32


@pytest.fixture(scope="module")
def clip_llava(tmp_path_factory: pytest.TempPathFactory) -> ClipLlava:
    folder = tmp_path_factory.mktemp("llava15")
    model = llava15_checkpoint(folder / "ckpt")
    ours = convert.convert(folder / "ckpt", folder / "llava15-f32.gguf", outtype="f32")
    return ClipLlava(folder / "ckpt", model, ours)


def _llava_scripts(llava: ClipLlava, folder: Path) -> dict[str, Path]:
    """llama.cpp's own route for LLaVA 1.5 (tools/mtmd/legacy-models): llava_surgery_v2.py takes the
    projector out of the checkpoint, convert_image_encoder_to_gguf.py writes it with the CLIP model
    (here: a CLIP model holding the checkpoint's tower, its config naming the checkpoint's feature
    layer) as F16 and F32 files; convert_hf_to_gguf.py writes the text model."""
    import transformers as tf

    scripts = llama_cpp_converter_dir(converter_cache())
    legacy = scripts / "tools" / "mtmd" / "legacy-models"
    clip = folder / "clip"
    tower = llava.model.model.vision_tower
    text = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
            "vocab_size": 8, "max_position_embeddings": 16}
    clip_model = tf.CLIPModel(tf.CLIPConfig(vision_config=tower.config.to_dict(), text_config=text, projection_dim=64))
    missing = clip_model.vision_model.load_state_dict(tower.state_dict(), strict=False).missing_keys
    assert missing == []
    clip_model.save_pretrained(clip)
    config = json.loads((clip / "config.json").read_text())
    (clip / "config.json").write_text(json.dumps({**config, "vision_feature_layer": -2}))
    (clip / "vocab.json").write_text(json.dumps({"<|startoftext|>": 0, "<|endoftext|>": 1}))
    (clip / "merges.txt").write_text("#version: 0.2\n")
    shutil.copy(llava.hf / "preprocessor_config.json", clip)
    surgery = _linked(llava.hf, folder / "surgery")

    def run(args: list[str]) -> None:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]

    run([str(legacy / "llava_surgery_v2.py"), "-m", str(surgery)])
    encoder = [str(legacy / "convert_image_encoder_to_gguf.py"), "-m", str(clip), "--llava-projector",
               str(surgery / "llava.projector"), "--output-dir", str(folder / "out")]
    jobs = [encoder, encoder + ["--use-f32"],
            [str(scripts / "convert_hf_to_gguf.py"), str(llava.hf), "--outtype", "f32", "--outfile",
             str(folder / "text-f32.gguf")]]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each run is a process of its own
        list(pool.map(run, jobs))
    return {"f16": folder / "out" / "mmproj-model-f16.gguf", "f32": folder / "out" / "mmproj-model-f32.gguf",
            "text": folder / "text-f32.gguf"}


# Keys ours writes in every file's header and llama.cpp's LLaVA scripts do not.
HEADER_ONLY = ("general.type", "general.size_label", "general.quantization_version")


def _ffn_names_swapped(path: Path, folder: Path) -> Path:
    """A copy of a projector file with each block's ffn_up and ffn_down names swapped (the names
    llama.cpp's LLaVA scripts give fc1 and fc2)."""
    reader = gguf_reader(path)
    out = folder / f"swapped-{path.name}"
    w = gguf.GGUFWriter(out, "clip")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value, kind = field.contents(), field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, kind, sub_type=field.types[-1])
        else:
            w.add_key_value(key, value, kind)
    swap = {"ffn_up": "ffn_down", "ffn_down": "ffn_up"}
    for t in reader.tensors:
        parts = t.name.split(".")
        name = ".".join(swap.get(p, p) for p in parts)
        w.add_tensor(name, t.data, raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.slow  # llama.cpp's LLaVA scripts and its converter, each loading transformers
def test_llava15_files_equal_llama_cpps_llava_scripts(clip_llava: ClipLlava, tmp_path: Path) -> None:
    """The text model equals convert_hf_to_gguf.py's; the projector, F16, equals the LLaVA scripts'
    bit for bit but for two things by design: fc1 and fc2 are named ffn_up and ffn_down (the scripts
    swap the two names and llama.cpp swaps them back at load, with a warning), and the header keys
    every file of ours has. F32: the same, but that the scripts write the patch embeddings and the
    projection matrices as F16 whatever the type; ours keep the checkpoint's F32."""
    refs = _llava_scripts(clip_llava, tmp_path)
    ours = clip_llava.ours
    assert ours.mmproj is not None
    text = assert_same_file(ours.path, refs["text"])
    assert text["general.architecture"] == "llama"
    f16 = convert.convert(clip_llava.hf, tmp_path / "m.gguf", outtype="f16").mmproj
    assert f16 is not None and f16.plan.notice and "issue 25814" in f16.plan.notice
    layout = _linked(clip_llava.hf, tmp_path / "saved", skip=("model.safetensors",))
    (layout / "model.safetensors").symlink_to(clip_llava.hf.with_name("saved") / "model.safetensors")
    saved = convert.convert(layout, tmp_path / "s.gguf", outtype="f16").mmproj
    assert saved is not None and gguf_tensors(saved.path) == gguf_tensors(f16.path)  # transformers 5's layout
    for path, ref in ((f16.path, refs["f16"]), (ours.mmproj.path, refs["f32"])):
        (got, got_t), (want, want_t) = _read(_ffn_names_swapped(path, tmp_path)), _read(ref)
        assert {k: v for k, v in got.items() if k not in HEADER_ONLY} == want
        assert got["general.type"] == "mmproj"
        assert list(got_t) == list(want_t)
        differ = {name for name in want_t if got_t[name] != want_t[name]}
        if path == f16.path:
            assert differ == set()
        else:  # the three the scripts write as F16: ours are F32, and hold the same values
            assert differ == {"mm.0.weight", "mm.2.weight", "v.patch_embd.weight"}
            for name in differ:
                assert (Q(got_t[name][0]), Q(want_t[name][0])) == (Q.F32, Q.F16)
    projector = assert_same_file(ours.mmproj.path, ours.mmproj.path)  # every key and type, spelled out
    assert projector["clip.projector_type"] == "mlp" and projector["clip.has_llava_projector"] is True
    assert projector["clip.vision.block_count"] == 2 and projector["clip.vision.feature_layer"] == [2]
    assert projector["clip.use_gelu"] is False  # CLIP's quick GELU
    assert "tensor:v.blk.2.attn_q.weight" not in projector and "tensor:v.post_ln.weight" not in projector
    assert projector["tensor:v.blk.0.ffn_up.weight"] == Q.F32


def test_llava15_converts_through_the_cli_which_says_how_llama_cpp_runs_it(clip_llava: ClipLlava,
                                                                           tmp_path: Path) -> None:
    folder = _linked(clip_llava.hf, tmp_path / "llava-tiny")
    res = run_cli("convert", str(folder), "--outtype", "f16")
    assert res.returncode == 0, res.stderr
    model, projector = folder / "llava-tiny-F16.gguf", folder / "mmproj-llava-tiny-F16.gguf"
    assert res.stdout.splitlines() == [str(model), str(projector)]
    notes = [line for line in res.stderr.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: {llava_clip.NOTICE}"]
    assert "issue 25814" in notes[0]
    info = api.get_model("llava-tiny:f16")
    assert Path(info.path) == model and info.details["mmproj"] == str(projector.resolve())
    # and every run of it says how llama.cpp reads its images
    image = test_image(tmp_path / "image.png", CLIP_SIDE, CLIP_SIDE)
    res = run_cli("run", "llava-tiny:f16", PROMPT, "--image", str(image), "-n", "2", "--temperature", "0")
    assert res.returncode == 0, res.stderr
    assert f"localrun: warning: 'llava-tiny:f16': {llama_vision.CLS_LAST}" in res.stderr.splitlines()


def _llama_cpp_image(text: Path, mmproj: Path, image: Path) -> Any:
    """The image's embeddings as llama.cpp's image encoder computes them (one row per image token)."""
    import numpy as np

    from localrun.backends.llama_loader import library
    from localrun.backends.llama_vision import Vision

    ll = library()
    model = ll.llama_model_load_from_file(str(text).encode(), ll.llama_model_default_params())
    vision = Vision(str(mmproj), model, 2, False)
    try:
        vision.tokenize(vision.marker, [image.read_bytes()], True)
        ((chunk, _),) = vision.chunks.values()
        assert vision.mt.mtmd_encode_chunk(vision.ctx, chunk) == 0
        n = vision.mt.mtmd_input_chunk_get_n_tokens(chunk)
        out = np.ctypeslib.as_array(vision.mt.mtmd_get_output_embd(vision.ctx), shape=(n * vision.n_embd,))
        return out.reshape(n, vision.n_embd).copy()
    finally:
        vision.close()
        ll.llama_model_free(model)


def _transformers_image(model: Any, image: Path, cls_last: bool) -> Any:
    """transformers' image features of the tower and projector: its own forward pass, or with the
    [CLS] token put after the patches as llama.cpp's graph does (patch i takes position i, [CLS]
    the last one, and the rows read are 1..n: the [CLS] output in place of the first patch's)."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(image) as file:
        pixels = np.asarray(file.convert("RGB"), dtype=np.float32) / 255.0
    pixels = (pixels - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)
    x = torch.from_numpy(pixels.transpose(2, 0, 1)[None].copy())
    with torch.no_grad():
        if not cls_last:
            return model.model.get_image_features(pixel_values=x).pooler_output[0].numpy()
        tower = model.model.vision_tower
        patches = tower.embeddings.patch_embedding(x).flatten(2).transpose(1, 2)
        h = torch.cat([patches, tower.embeddings.class_embedding[None, None]], 1)
        h = tower.pre_layrnorm(h + tower.embeddings.position_embedding.weight[None])
        for layer in tower.encoder.layers[:2]:  # vision_feature_layer -2 of 3
            h = layer(h, None)
            h = h[0] if isinstance(h, tuple) else h
        return model.model.multi_modal_projector(h[0, 1:]).numpy()


def test_llava15_files_run_in_llama_cpp_as_its_graph_says_and_reply_as_transformers_on_those_features(
        clip_llava: ClipLlava, tmp_path: Path) -> None:
    """llama.cpp loads our pair. Its image embeddings equal transformers' tower and projector, F32,
    within 1e-3, computed with the [CLS] token after the patches: llama.cpp's graph does so (its issue
    25814), and they are not transformers' own forward pass (when a llama.cpp update fixes the graph,
    this assert fails and the comparison becomes transformers' own). The greedy reply through the
    engine equals transformers' text model given those image features, token for token."""
    import numpy as np
    import torch

    ours = clip_llava.ours
    assert ours.mmproj is not None
    tok = _tokenizer("llama2-spm")
    replies = []
    for seed in (0, 1):
        image = test_image(tmp_path / f"image{seed}.png", CLIP_SIDE, CLIP_SIDE, seed=seed)
        got = _llama_cpp_image(ours.path, ours.mmproj.path, image)
        graph = _transformers_image(clip_llava.model, image, cls_last=True)
        assert np.abs(got - graph).max() < 1e-3 * np.abs(graph).max()
        own = _transformers_image(clip_llava.model, image, cls_last=False)
        assert np.abs(got - own).max() > 0.1 * np.abs(own).max()  # llama.cpp issue 25814, still there
        reply, info = _engine_reply(ours, image)
        assert info["warning"] == llama_vision.CLS_LAST  # said to whoever runs it
        embed = clip_llava.model.get_input_embeddings()
        ids = tok.encode(PROMPT, add_special_tokens=False)
        with torch.no_grad():
            inputs = torch.cat([embed(torch.tensor([tok.bos_token_id])), torch.from_numpy(graph),
                                embed(torch.tensor(ids))])[None]
            out = clip_llava.model.generate(inputs_embeds=inputs, attention_mask=torch.ones(inputs.shape[:2]),
                                            max_new_tokens=8, do_sample=False)
        pieces = tok.convert_ids_to_tokens(out[0, -8:].tolist())
        want = [bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("\u2581", " ").encode()
                for p in pieces]
        assert reply == want
        replies.append(reply)
    assert replies[0] != replies[1]  # the reply depends on the image


SUPPORTED_VISION = (
    "Gemma3ForConditionalGeneration, Idefics3ForConditionalGeneration, LlavaForConditionalGeneration, "
    "Mistral3ForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, "
    "SmolVLMForConditionalGeneration"
)


def _config_only(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_vision_family_not_supported_yet_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    folder = _config_only(tmp_path / "llava-next", {
        "architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next",
        "text_config": {"model_type": "llama"}, "vision_config": {"model_type": "clip_vision_model"}})
    res = run_cli("convert", str(folder))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "localrun: vision-language architecture 'LlavaNextForConditionalGeneration' is not supported yet; "
        f"vision-language architectures the converter supports: {SUPPORTED_VISION}"
    ]
    assert list(folder.iterdir()) == [folder / "config.json"]


def test_llava_with_another_tower_is_refused_by_name_with_the_supported_ones(tmp_path: Path) -> None:
    """LLaVA-Interleave's SigLIP tower: llama.cpp has no projector reading it under this class name."""
    folder = _config_only(tmp_path / "llava", {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
        "text_config": {"model_type": "qwen2"}, "vision_config": {"model_type": "siglip_vision_model"}})
    res = run_cli("convert", str(folder))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "localrun: LlavaForConditionalGeneration with a 'siglip_vision_model' vision tower is not supported; "
        "convert LLaVA with a CLIP tower (LLaVA 1.5) or a Pixtral one (Pixtral 12B), or another of the "
        f"vision-language architectures the converter supports: {SUPPORTED_VISION}"
    ]
    assert list(folder.iterdir()) == [folder / "config.json"]


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "pixtral"},
      "vision_feature_layer": -2, "vision_feature_select_strategy": "default"},
     "LlavaForConditionalGeneration reads the vision tower's layer -2 ('default' patches); llama.cpp's "
     "pixtral projector reads every patch of its last layer"),
    ({"architectures": ["Mistral3ForConditionalGeneration"], "vision_config": {"model_type": "pixtral"},
      "text_config": {"model_type": "mistral4"}},
     "Mistral3ForConditionalGeneration with a 'mistral4' text model is not supported yet"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip_vision_model"},
      "vision_feature_select_strategy": "full"},
     "LlavaForConditionalGeneration with a CLIP tower reads its patches with strategy 'full'; llama.cpp's mlp "
     "projector leaves out the [CLS] token ('default')"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip_vision_model"},
      "projector_hidden_act": "silu"},
     "LlavaForConditionalGeneration's projection (silu, bias True) is not llama.cpp's mlp projector (GELU "
     "between two linear layers with biases)"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip_vision_model"},
      "vision_feature_layer": [-2, -5]},
     "LLaVA with a CLIP tower reading several layers ([-2, -5]) is not supported"),
    ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "clip_vision_model",
      "num_hidden_layers": 4}, "vision_feature_layer": -6},
     "vision_feature_layer -6 is outside the tower's 4 layers"),
], ids=["feature-layer", "mistral4", "clip-full", "clip-silu", "clip-layers", "clip-range"])
def test_llava_variants_llama_cpp_would_run_otherwise_fail_before_reading_weights(
        config: dict[str, Any], message: str, tmp_path: Path) -> None:
    folder = _config_only(tmp_path / "ckpt", config)
    with pytest.raises(convert.ConvertError) as e:
        convert.convert(folder, tmp_path / "m.gguf", outtype="f32")
    assert e.value.message == message
    assert list(tmp_path.glob("*.gguf")) == []


def test_a_config_that_names_its_class_only_in_text_config_is_planned_as_the_same_pair(tmp_path: Path) -> None:
    """transformers 4.57 saves a Qwen2-VL's `architectures` only in text_config."""
    hf = qwen2vl("f32").hf
    folder = _linked(hf, tmp_path / "ckpt", skip=("config.json",))
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["architectures"] = config.pop("architectures")
    (folder / "config.json").write_text(json.dumps(config))
    planned = convert.convert(folder, tmp_path / "m.gguf", outtype="f16", dry_run=True)
    assert planned.mmproj is not None and planned.mmproj.plan.arch == "clip"
    assert planned.plan.arch == "qwen2vl" and planned.mmproj.path == tmp_path / "mmproj-m.gguf"
    assert list(tmp_path.glob("*.gguf")) == []


def test_a_checkpoint_without_its_image_processor_config_fails_before_writing(tmp_path: Path) -> None:
    folder = _linked(qwen2vl("f32").hf, tmp_path / "ckpt", skip=("preprocessor_config.json",))
    with pytest.raises(convert.ConvertError) as e:
        convert.convert(folder, tmp_path / "m.gguf", outtype="f32")
    assert e.value.message == "the image processor's image_mean is missing"
    assert e.value.hint == "copy the model's preprocessor_config.json into the checkpoint folder"
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".*")) == []

