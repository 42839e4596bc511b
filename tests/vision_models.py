"""A tiny random Qwen2-VL converted by llama.cpp's own converter, and transformers' reference on it.

Shared by the tests of image input. `qwen2vl()` builds, once per machine and cached, a Qwen2-VL
checkpoint in Hugging Face layout (2 text layers, 3 vision blocks, random weights from a fixed seed,
the real Qwen3 tokenizer, Qwen2-VL's own chat template and image processor settings) and converts
it with llama.cpp's `convert_hf_to_gguf.py` (from the llama-cpp-python sdist) into a text GGUF and a
projector (`--mmproj`) GGUF. `reference_greedy()` is what transformers generates from it for one
user turn [image, text].

The weights are unit-scale (see _peak): the attention over the 12 image positions moves the residual
stream enough that another image gives another text, and a few "hub" output rows widen the top-1
margins. Margins still vary (Reference.margins): llama.cpp's logits differ from transformers' by a
few hundredths (F16 KV cache), so compare greedy tokens where the reference's margin is wider.

A 112x84 image (both sides multiples of 28, patch 14 x merge 2) is not resized by either side's
preprocessing: 8x6 patches, 4x3 = 12 image tokens after the 2x2 merge, the same pixels on both sides.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.conftest import ASSETS, assets_or_skip, skip_or_fail
from tests.convert.convert_helpers import LLAMA_CPP_PYTHON, converter_cache, llama_cpp_converter_dir

# Bump when the recipe below changes: it names the cache folder.
RECIPE = 1
NAME = "qwen2vl-tiny"
TOKENIZER = ASSETS / "tokenizers" / "qwen3"
DTYPES = ("f32", "f16")
HIDDEN, HEADS, KV_HEADS = 64, 4, 2  # text: head_dim 16
MROPE_SECTION = [2, 3, 3]  # M-RoPE's temporal, height and width shares of the head_dim / 2 pairs
HUBS, HUB_SCALE = 32, 3.0  # output rows made longer: see _peak

# Qwen2-VL's own image statistics (those of CLIP) and patching.
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]
PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280  # Qwen2-VL's defaults: 112x84 is kept as it is

# How the chat template writes one image: transformers expands the pad to one per image token;
# llama.cpp's mtmd writes the start/end tokens itself around the embeddings of a media marker.
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL-Instruct's chat template, as published with the model (a default system prompt).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class VisionModel:
    """One build of the tiny Qwen2-VL: the checkpoint and llama.cpp's two files of it."""

    hf: Path  # the Hugging Face folder (config, safetensors, tokenizer, preprocessor_config.json)
    gguf: Path  # the text model (architecture qwen2vl)
    mmproj: Path  # the projector (clip, qwen2vl_merger)


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of one user turn [image, text]."""

    prompt: str  # the rendered chat prompt, the image written as IMAGE
    prompt_ids: list[int]  # what the model read: IMAGE_PAD repeated once per image token
    image_tokens: int  # image tokens after the merge (12 for 112x84)
    tokens: list[int]  # the n greedy tokens (EOS is not special: always n of them)
    text: str  # tokens decoded, special tokens kept
    margins: list[float]  # top-1 minus top-2 logit at each step


# LLaVA 1.5 (llava-hf) in small: a CLIP tower read at its last-but-one layer without [CLS], an MLP projector.
LLAVA_IMAGE = 32000  # the <image> token, after the Llama 2 vocabulary
CLIP_SIDE, CLIP_PATCH = 64, 16  # 16 patches; a test image of this size is not resized
CLIP_MEAN, CLIP_STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]


def clear_margins(model: Any, seed: int) -> None:
    """Random weights (randomize) whose greedy reply depends on the image, with top-1 margins far
    above F32 rounding: unit-scale embeddings and output rows, the text model's output projections
    tripled."""
    import torch

    from tests.convert.convert_helpers import randomize

    randomize(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (model.get_input_embeddings().weight, model.lm_head.weight):
            p.copy_(torch.randn(p.shape, generator=g))
        for name, p in model.named_parameters():
            if "language_model." in name and name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(3.0)


def llava15_checkpoint(folder: Path) -> Any:
    """A tiny random llava-hf LLaVA 1.5: a 3-layer CLIP tower (quick GELU), read at layer -2 without
    its [CLS] token, a GELU projector with biases, a Llama text model; weights as the Pixtral ones.
    Saved in the published layout (vision_tower.vision_model.*), with llava-hf's processor settings;
    transformers 5's own layout, beside it in "saved", has no vision_model. Returns the model."""
    import torch
    import transformers as tf
    from safetensors.numpy import load_file, save_file

    from tests.convert.convert_helpers import need_asset

    text = {"model_type": "llama", "vocab_size": LLAVA_IMAGE + 2, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "rms_norm_eps": 1e-5}
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
              "num_attention_heads": 2, "image_size": CLIP_SIDE, "patch_size": CLIP_PATCH, "projection_dim": 64}
    config = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=LLAVA_IMAGE,
                            vision_feature_layer=-2, vision_feature_select_strategy="default",
                            projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(config)
    clear_margins(model, seed=5)
    model.eval().save_pretrained(folder.with_name("saved"))
    saved = folder.with_name("saved")
    shutil.copytree(saved, folder)  # llava-hf's files name the tower vision_model
    tensors = load_file(saved / "model.safetensors")
    tower = "vision_tower."
    save_file({f"{tower}vision_model.{k[len(tower):]}" if k.startswith(tower) else k: v
               for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "added_tokens_decoder": {
            str(LLAVA_IMAGE): {"content": "<image>", "special": True},
            str(LLAVA_IMAGE + 1): {"content": "<pad>", "special": True}}}))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "size": {"shortest_edge": CLIP_SIDE}, "crop_size": {"height": CLIP_SIDE, "width": CLIP_SIDE}}))
    (folder / "processor_config.json").write_text(json.dumps({  # llava-hf's: how many image tokens
        "processor_class": "LlavaProcessor", "image_token": "<image>", "patch_size": CLIP_PATCH,
        "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"}))
    return model


def qwen2vl(dtype: str = "f32") -> VisionModel:
    """The tiny Qwen2-VL and its text and projector GGUFs of dtype ("f32" or "f16").

    Built on first use under the test cache (LOCALRUN_TEST_CACHE, else ~/.cache/localrun-tests) in
    vision/qwen2vl-tiny-r<RECIPE>-llama<version>/ and reused after: each file appears complete or
    not at all (written aside and renamed), so concurrent or interrupted builds are harmless."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    root = converter_cache() / "vision" / f"{NAME}-r{RECIPE}-llama{LLAMA_CPP_PYTHON}"
    hf = root / "Qwen2-VL-tiny"  # the converter names the model (general.name) after the folder
    if not (hf / "config.json").is_file():
        _build_checkpoint(hf)
    model = VisionModel(hf, root / f"{NAME}-{dtype}.gguf", root / f"mmproj-{NAME}-{dtype}.gguf")
    converter = None
    for out, mmproj in ((model.mmproj, True), (model.gguf, False)):
        if not out.is_file():
            converter = converter or llama_cpp_converter_dir(converter_cache())
            _convert(converter, hf, out, dtype, mmproj)
    return model


def test_image(path: Path, width: int = 112, height: int = 84, seed: int = 0) -> Path:
    """Write a deterministic RGB PNG at path (random 7x7-pixel blocks over a gradient); returns path.

    Another seed gives an unrelated image. Keep both sides multiples of 28 for an image that neither
    side resizes."""
    import numpy as np

    image_module = _pil()
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=((height + 6) // 7, (width + 6) // 7, 3))
    noise = blocks.repeat(7, axis=0).repeat(7, axis=1)[:height, :width]
    y, x = np.mgrid[0:height, 0:width]
    gradient = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                         np.full_like(x, 128 * (seed % 2))], axis=-1)
    pixels = (0.75 * noise + 0.25 * gradient).round().clip(0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_module.fromarray(pixels, "RGB").save(path, format="PNG")
    return path


test_image.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test, where imported


def chat_prompt(prompt: str, media: str = IMAGE) -> str:
    """The model's chat template rendered for one user turn [image, prompt], with the generation
    prompt and the template's default system prompt; the image is written as `media`.

    For llama.cpp pass mtmd's marker (`mtmd_default_marker()`, "<__media__>"): mtmd adds
    <|vision_start|> and <|vision_end|> around the image embeddings itself."""
    rendered = _tokenizer_of(str(assets_or_skip(TOKENIZER))).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}],
        chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert rendered.count(IMAGE) == 1, rendered
    return rendered.replace(IMAGE, media)


def reference_greedy(model: VisionModel, image: Path, prompt: str, n: int) -> Reference:
    """transformers' greedy continuation (F32) of chat_prompt(prompt) with the image: n tokens.

    Each step is a full forward pass over the prompt and the tokens so far (no KV cache: exact and
    cheap on this model); EOS does not stop it. Equal to `generate(do_sample=False)` until an EOS."""
    import torch

    hf_model, tok, processor = _loaded(str(model.hf))
    pixels, grid, count = _pixels(processor, image)
    rendered = chat_prompt(prompt)
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids = prompt_ids(tok, rendered, count)
    tokens: list[int] = []
    margins: list[float] = []
    with torch.no_grad():
        for _ in range(n):
            input_ids = torch.tensor([ids + tokens])
            logits = hf_model(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                image_grid_thw=grid, mm_token_type_ids=(input_ids == pad).long(),  # 1: image token
                use_cache=False,
            ).logits[0, -1]
            top = torch.topk(logits.float(), 2)
            tokens.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
    return Reference(rendered, ids, count, tokens, tok.decode(tokens, skip_special_tokens=False), margins)


def prompt_ids(tok: Any, rendered: str, count: int) -> list[int]:
    """A rendered Qwen-VL prompt's token ids as the model reads them: IMAGE_PAD once per image token."""
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids: list[int] = []
    for token in tok(rendered, add_special_tokens=False)["input_ids"]:
        ids.extend([token] * count if token == pad else [token])
    return ids


def reference_image_embeddings(model: VisionModel, image: Path) -> Any:
    """The vision tower and merger's output for the image (F32 numpy, image tokens x text width):
    what mtmd's encoder computes from the projector file for the same pixels."""
    import torch

    hf_model, _, processor = _loaded(str(model.hf))
    pixels, grid, _ = _pixels(processor, image)
    with torch.no_grad():
        (embeddings,) = hf_model.model.get_image_features(pixels, grid).pooler_output
    return embeddings.float().numpy()


# --- Qwen2.5-VL, Gemma 3 and SmolVLM (tests/test_vision_families.py, tests/mlx/test_mlx_vision.py) ---

# Gemma 3 and SmolVLM: the Llama 2 vocabulary with their image tokens after it
GEMMA3_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# (and "\n\n", one token in SmolVLM's vocabulary, which mtmd puts before the overview)
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)), "\n\n"]
TILE = 56  # Gemma 3's and SmolVLM's SigLIP input side (4x4 patches of 14)


def _spm_with(folder: Path, tokens: list[str], **config: Any) -> None:
    """The Llama 2 SentencePiece tokenizer with tokens added after its 32000 (those in <> special),
    and more tokenizer_config.json settings."""
    from tests.convert.convert_helpers import need_asset

    shutil.copy(need_asset("tokenizers", "llama2-spm", "tokenizer.model"), folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "added_tokens_decoder": {str(32000 + i): {"content": t, "special": t.startswith("<")}
                                 for i, t in enumerate(tokens)}, **config}))


def qwen25vl_checkpoint(folder: Path) -> tuple[Any, int]:
    """A tiny random Qwen2.5-VL with Qwen3's tokenizer and chat template (a thinking one, as
    Qwen3-VL's; Qwen2.5-VL's own is CHAT_TEMPLATE) and Qwen2-VL's image processor. Returns the
    model and its image token."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(TOKENIZER)))
    shared = _qwen_vl_config(tok)
    config = tf.Qwen2_5_VLConfig(
        # windows of 4x4 merged tokens (112 pixels, the published size, which llama.cpp assumes),
        # full attention in every second block
        vision_config={
            "depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": HIDDEN,
            "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL, "window_size": 112,
            "fullatt_block_indexes": [1, 3], "in_channels": 3,
        },
        **shared,
    )
    torch.manual_seed(0)
    model = tf.Qwen2_5_VLForConditionalGeneration(config)
    clear_margins(model, seed=7)
    model.eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    _save_image_processor(folder)
    return model, shared["image_token_id"]


def gemma3_config(vocab_size: int, boi: int, eoi: int, image: int) -> Any:
    """A tiny Gemma 3's config: 2 text layers (one sliding-window, window 8), SigLIP at 56x56 in
    4x4 patches pooled to 2x2 image tokens; the image delimiters and token as given."""
    import transformers as tf

    return tf.Gemma3Config(
        text_config={
            "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
            "max_position_embeddings": 4096, "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
            "image_size": TILE, "patch_size": 14, "num_channels": 3, "vision_use_head": False,
        },
        mm_tokens_per_image=4, boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )


def gemma3_checkpoint(folder: Path) -> tuple[Any, int]:
    """A tiny random Gemma 3 (SigLIP at 56x56 pooled to 2x2 image tokens) in the published layout
    (the vision tower's tensors under vision_model, as transformers 4 saved them), with Gemma 3's
    processor settings. Returns the model and its image token."""
    import torch
    import transformers as tf
    from safetensors.numpy import load_file, save_file

    boi, eoi, soft = (32000 + i for i in range(3))
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(gemma3_config(32003, boi, eoi, soft))
    clear_margins(model, seed=7)
    with torch.no_grad():  # tied, and scaled by sqrt(64) on the way in: unit-scale there, not in the output
        model.get_input_embeddings().weight.mul_(1 / 8)
    model.eval().save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tower = "vision_tower."
    save_file({f"{tower}vision_model.{k[len(tower):]}" if k.startswith(tower) else k: v for k, v in tensors.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    _spm_with(folder, GEMMA3_TOKENS, extra_special_tokens={
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Gemma3ImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "size": {"height": TILE, "width": TILE}, "image_seq_length": 4}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": 4}))
    return model, soft


def idefics3_checkpoint(folder: Path, tokens: list[str] = IDEFICS3_TOKENS) -> tuple[Any, int]:
    """A tiny random Idefics3 / SmolVLM (a Llama text model; SigLIP tiles of 56x56, 4 image tokens
    each after the pixel shuffle), with SmolVLM's processor settings: an image up to 2 tiles a side,
    cut into tiles plus the whole image shrunk to one. Returns the model and its image token."""
    import torch
    import transformers as tf

    image = 32000 + tokens.index("<image>")
    config = tf.Idefics3Config(
        text_config={
            "model_type": "llama", "vocab_size": 32000 + len(tokens), "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2,
            "image_size": TILE, "patch_size": 14, "num_channels": 3,
        },
        scale_factor=2, image_token_id=image, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.Idefics3ForConditionalGeneration(config)
    clear_margins(model, seed=7)
    model.eval().save_pretrained(folder)
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    saved["text_config"]["architectures"] = ["LlamaForCausalLM"]
    path.write_text(json.dumps(saved))
    _spm_with(folder, tokens)
    # the whole image at most 2 tiles a side: a 112x112 image is 2x2 tiles and the overview
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Idefics3ImageProcessor", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
         "size": {"longest_edge": 2 * TILE}, "max_image_size": {"longest_edge": TILE}}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Idefics3Processor", "image_seq_len": 4}))
    return model, image


# Qwen2.5-VL's 168x84: 6x3 merged tokens in two windows, 4x3 and 2x3
FAMILIES = {"qwen2.5-vl": (qwen25vl_checkpoint, (168, 84)), "gemma3": (gemma3_checkpoint, (TILE, TILE)),
            "smolvlm": (idefics3_checkpoint, (2 * TILE, 2 * TILE))}


def token_bytes(tok: Any, token: int) -> bytes:
    """A token's bytes as the vocabulary holds them (SentencePiece or byte-level BPE)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    piece = tok.convert_ids_to_tokens(token)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])
    if "\u2581" in piece or tok.convert_tokens_to_ids("\u2581") != tok.unk_token_id:  # SentencePiece
        return piece.replace("\u2581", " ").encode()
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(decoder[c] for c in piece)


# --- building ---------------------------------------------------------------------------------


def _build_checkpoint(hf: Path) -> None:
    """Write the checkpoint folder aside, then rename it to hf (a concurrent build may win)."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(TOKENIZER)))  # not _tokenizer_of's: changed
    missing = [name for name in VISION_TOKENS if tok.convert_tokens_to_ids(name) in (None, tok.unk_token_id)]
    if missing:  # the Qwen3 tokenizer has them (151652-151656); another one may not
        tok.add_special_tokens({"additional_special_tokens": missing})  # type: ignore[dict-item]
    config = tf.Qwen2VLConfig(
        vision_config={
            # 3 blocks: the converter's tensor map needs at least 3; hidden_size is the merger's output
            "depth": 3, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 4, "hidden_size": HIDDEN,
            "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TEMPORAL,
            "in_channels": 3,
        },
        **_qwen_vl_config(tok),
    )
    torch.manual_seed(0)
    model = tf.Qwen2VLForConditionalGeneration(config)
    _peak(model, seed=0)
    model.eval()

    hf.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=hf.parent))
    try:
        work.chmod(0o755)  # mkdtemp's 0700
        model.save_pretrained(work)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(work)
        _save_image_processor(work)
        # Older transformers (4.57) kept `architectures` only in text_config, where the
        # converter's --mmproj does not look.
        path = work / "config.json"
        saved = json.loads(path.read_text())
        saved["architectures"] = ["Qwen2VLForConditionalGeneration"]
        path.write_text(json.dumps(saved, indent=2) + "\n")
        try:
            os.rename(work, hf)
        except OSError:
            if not (hf / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _qwen_vl_config(tok: Any) -> dict[str, Any]:
    """What the tiny Qwen2-VL and Qwen2.5-VL configs share: the text model (2 layers, M-RoPE) on
    tok's vocabulary, and the ids of the vision tokens."""
    assert sum(MROPE_SECTION) * 2 == HIDDEN // HEADS
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   (tok.convert_tokens_to_ids(name) for name in VISION_TOKENS), strict=True))
    return {
        "text_config": {
            "vocab_size": len(tok), "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": MROPE_SECTION},
            "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        },
        "tie_word_embeddings": False,
        **ids,
    }


def _save_image_processor(folder: Path) -> None:
    """Qwen2-VL's image processor settings (a 112x84 image is kept as it is) into folder."""
    _image_processor()(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH, merge_size=MERGE,
        temporal_patch_size=TEMPORAL, image_mean=IMAGE_MEAN, image_std=IMAGE_STD,
    ).save_pretrained(folder)


def _peak(model: Any, seed: int) -> None:
    """Random weights whose greedy text depends on the image, with wider top-1 margins.

    Unit-scale embeddings and output rows, matrices scaled by 1/sqrt(fan-in) (unit activations).
    The output is not tied to the embeddings: tied, each token predicts itself and the text is one
    token repeated whatever the image. HUBS output rows are HUB_SCALE longer: the winners come
    mostly from them, several times further apart than among 151k equal rows."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                if name.endswith("bias"):
                    p.copy_((torch.rand(p.shape, generator=g) - 0.5) * 0.2)
                else:
                    p.copy_(1.0 + (torch.rand(p.shape, generator=g) - 0.5) * 0.6)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
        plain = model.config.text_config.bos_token_id  # ordinary text tokens lie below the specials
        hubs = torch.randperm(plain, generator=g)[:HUBS]
        model.lm_head.weight[hubs] *= HUB_SCALE


def _convert(converter: Path, hf: Path, out: Path, dtype: str, mmproj: bool) -> None:
    """llama.cpp's convert_hf_to_gguf.py of hf into out (the projector with mmproj), atomically."""
    part = out.with_name(f".{out.name}.{os.getpid()}.part")
    command = [sys.executable, str(converter / "convert_hf_to_gguf.py"), str(hf),
               "--outtype", dtype, "--outfile", str(part)]
    proc = subprocess.run(command + (["--mmproj"] if mmproj else []), capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's converter failed on {hf} ({' '.join(command[2:])}"
                           f"{' --mmproj' if mmproj else ''}):\n{proc.stderr[-3000:]}")
    os.replace(part, out)


# --- transformers' side -----------------------------------------------------------------------


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        skip_or_fail("Pillow is not installed (transformers' Qwen2-VL image processor needs it)")
    return Image


def _image_processor() -> Any:
    """Qwen2-VL's image processor class on Pillow (torchvision's would do the same without resize)."""
    _pil()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil


@functools.cache
def _tokenizer_of(folder: str) -> Any:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(folder)


@functools.cache
def _loaded(folder: str) -> tuple[Any, Any, Any]:
    """The F32 model, tokenizer and image processor of a checkpoint folder (once per process).

    Qwen2VLProcessor itself is not used: it insists on a video processor, which needs
    torchvision; its image part is this image processor and a repeat of IMAGE_PAD."""
    import torch
    import transformers as tf

    model = tf.Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model, _tokenizer_of(folder), _image_processor().from_pretrained(folder)


def _pixels(processor: Any, image: Path) -> tuple[Any, Any, int]:
    """pixel_values, image_grid_thw and the number of image tokens of one image file."""
    with _pil().open(image) as file:
        rgb = file.convert("RGB")
    batch = processor(images=[rgb], return_tensors="pt")
    grid = batch["image_grid_thw"]
    return batch["pixel_values"], grid, int(grid[0].prod()) // MERGE**2
