"""Images on the MLX engine through mlx-vlm: the tiny random Qwen2-VL of tests/vision_models.py,
converted by mlx-vlm's own converter, against transformers' forward pass on the same pixels,
through the engine loop (a worker process) and the CLI.

mlx-vlm 0.7.10 cannot convert the checkpoint as transformers 5 saves it: its Qwen2-VL ModelConfig
rebuilds text_config from the root of config.json (the layout Qwen2-VL was published in), where
transformers 5 keeps no text settings ("TextConfig.__init__() missing 6 required positional
arguments: 'hidden_size', ..."); its TextConfig reads the M-RoPE sections from rope_scaling only
(transformers 5: rope_parameters; without them it takes Qwen3-VL's [24, 20, 20], which does not
fit this model's 16-wide heads), and its vision tower accepts model_type "qwen2_vl" only
(transformers 5: "qwen2_vl_vision"). The conversion therefore reads the checkpoint through
mlx_vision.config_view(), the same view the engine loads such checkpoints through. The processor
(mlx-vlm's numpy port of Qwen2-VL's, no resize at 112x84) and the chat template (the model's own,
rendered with the image as a content part, as transformers renders it) then agree with
transformers' exactly: the prompt ids are equal, image tokens included.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.constraint import Constraint
from localrun.errors import BadModelFileError, UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo
from tests.conftest import run_cli, skip_or_fail
from tests.vision_models import VisionModel, qwen2vl, reference_greedy, test_image

from .conftest import Models, load

PROMPT = "Describe this image."
GREEDY = GenerationParams(temperature=0, max_tokens=8)


def mlx_vlm_folder(hf: Path) -> Path:
    """mlx-vlm's float32 conversion of the checkpoint, cached beside it (written aside, then renamed)."""
    from importlib.metadata import version

    from mlx_vlm.convert import convert

    from localrun.backends.mlx_vision import config_view

    out = hf.parent / f"{hf.name}-mlx-vlm{version('mlx-vlm')}-f32"
    if (out / "config.json").is_file():
        return out
    work = Path(tempfile.mkdtemp(prefix=".mlx-vlm-", dir=hf.parent))
    try:
        with config_view(hf) as view:  # see the module's docstring
            convert(str(view), str(work / "model"), dtype="float32")
        try:
            os.rename(work / "model", out)
        except OSError:
            if not (out / "config.json").is_file():  # a concurrent build may have won
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


@pytest.fixture(scope="module", autouse=True)
def _mlx_vlm() -> None:
    from localrun.backends.mlx_vision import vlm_installed

    if not vlm_installed():
        skip_or_fail("mlx-vlm is not installed (pip install 'localrun[mlx-vision]')")


@pytest.fixture(scope="module")
def vl() -> VisionModel:
    return qwen2vl("f32")


@pytest.fixture(scope="module")
def folder(vl: VisionModel) -> Path:
    return mlx_vlm_folder(vl.hf)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("pictures")
    return [test_image(root / f"image{seed}.png", seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def session(folder: Path) -> Any:
    """The converted model in a worker process with three sequence slots."""
    info = api.get_model(str(folder))
    s = api.load(info, LoadOptions(n_ctx=512, n_parallel=3), engine="mlx")
    yield s
    s.close()


def ask(session: Any, messages: list[dict[str, Any]], params: GenerationParams = GREEDY) -> tuple[str, Any]:
    chunks = list(api.stream(session, Request.chat(messages), params))
    assert all(c.text for c in chunks[:-1]), "text chunks are never empty"
    return "".join(c.text for c in chunks), chunks[-1]


def user(text: str, *images: Path) -> dict[str, Any]:
    return {"role": "user", "content": text, "images": [p.read_bytes() for p in images]}


def transformers_greedy(vl: VisionModel, messages: list[dict[str, Any]], n: int, picture: Path | None = None) -> str:
    """transformers' greedy continuation of a conversation (the first user turn shows `picture`),
    one full forward pass per token as reference_greedy does for a single turn."""
    import torch

    from tests.vision_models import CHAT_TEMPLATE, IMAGE_PAD, _loaded, _pixels, prompt_ids

    model, tok, processor = _loaded(str(vl.hf))
    shown = [{**m, "content": [{"type": "image"}, {"type": "text", "text": m["content"]}]} if i == 0 and picture else m
             for i, m in enumerate(messages)]
    rendered = tok.apply_chat_template(shown, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    inputs: dict[str, Any] = {}
    count = 0
    if picture is not None:
        pixels, grid, count = _pixels(processor, picture)
        inputs = {"pixel_values": pixels, "image_grid_thw": grid}
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids = prompt_ids(tok, rendered, count)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            input_ids = torch.tensor([ids + out])
            logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                           mm_token_type_ids=(input_ids == pad).long(), use_cache=False, **inputs).logits[0, -1]
            out.append(int(logits.argmax()))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return str(tok.decode(out[:out.index(eos)] if eos in out else out, skip_special_tokens=False))


def test_greedy_replies_equal_transformers_on_the_same_pixels(vl: VisionModel, session: Any,
                                                             pictures: list[Path]) -> None:
    """mlx-vlm's processor, vision tower and language model inside the engine loop give
    transformers' own greedy continuation (F32 both, no margin near a tie), and another image gives
    another reply."""
    replies = []
    for picture in pictures:
        ref = reference_greedy(vl, picture, PROMPT, 8)
        assert min(ref.margins) > 0.05, "a near tie would make the comparison a coin toss"
        text, end = ask(session, [user(PROMPT, picture)])
        assert text == ref.text, picture.name
        # every image token counts (12 for 112x84), as the model reads them
        assert end.prompt_tokens == len(ref.prompt_ids) and end.images_encoded == 1
        assert end.completion_tokens == 8 and end.finish_reason == "length"
        replies.append(text)
    assert replies[0] != replies[1]
    assert session.info()["vision"] == "mlx-vlm (qwen2_vl)"


def test_text_requests_and_the_next_turn_on_the_vision_model(vl: VisionModel, session: Any,
                                                              pictures: list[Path]) -> None:
    """A request without images runs on the same model; a conversation's next turn finds its image
    in the KV cache (not encoded again, M-RoPE positions from the whole prompt) and answers as
    transformers does the whole conversation."""
    story = [{"role": "user", "content": "Tell me a story."}]
    text, end = ask(session, story)
    assert text == transformers_greedy(vl, story, 8) and end.images_encoded == 0
    first, end1 = ask(session, [user(PROMPT, pictures[0])])
    conversation = [user(PROMPT, pictures[0]), {"role": "assistant", "content": first},
                    {"role": "user", "content": "And the colours?"}]
    second, end2 = ask(session, conversation)
    assert end2.images_encoded == 0 and end2.cached_tokens >= end1.prompt_tokens
    plain = [{k: v for k, v in m.items() if k != "images"} for m in conversation]
    assert second == transformers_greedy(vl, plain, 8, pictures[0])


def test_sampling_stops_and_parallel_sequences(session: Any, pictures: list[Path]) -> None:
    """A request's seed, temperature, top-k and stop strings hold for image requests, and three
    requests at once (two images, one text) each get the reply they get alone."""
    asks = [[user(PROMPT, pictures[0])], [user(PROMPT, pictures[1])], [{"role": "user", "content": "Tell me a story."}]]
    greedy = ask(session, asks[1])[0]
    sampled = GenerationParams(temperature=1.5, top_p=0.95, seed=7, max_tokens=8)
    once, again = ask(session, asks[1], sampled)[0], ask(session, asks[1], sampled)[0]
    assert once == again and once != greedy  # at this heat the seed decides, and not as argmax would
    assert ask(session, asks[1], GenerationParams(temperature=1.5, top_k=1, seed=1, max_tokens=8))[0] == greedy
    cut, end = ask(session, asks[1], GenerationParams(temperature=0, max_tokens=8, stop=(greedy[6:9],)))
    assert cut == greedy[:6] and end.finish_reason == "stop"
    colours = Constraint.choice(["red", "green", "blue"]).grammar  # the logits processors run on these sequences too
    assert ask(session, asks[1], GenerationParams(temperature=1.0, seed=3, max_tokens=10, grammar=colours))[0] \
        in ("red", "green", "blue")

    params = GenerationParams(temperature=0, max_tokens=16)
    alone = [ask(session, m, params)[0] for m in asks]
    with ThreadPoolExecutor(3) as pool:  # each request from its own thread, as a server's clients
        together = list(pool.map(lambda m: ask(session, m, params)[0], asks))
    assert together == alone


def test_bad_images_fail_their_own_request_and_the_engine_goes_on(session: Any, tmp_path: Path) -> None:
    picture = test_image(tmp_path / "image2.png", seed=2)  # not in any slot's KV cache yet
    whole = picture.read_bytes()
    truncated = whole[: len(whole) // 2]  # the header says 112x84; the pixels stop half way
    with pytest.raises(UsageError, match="image 1 of the request could not be decoded"):
        ask(session, [{"role": "user", "content": PROMPT, "images": [truncated]}])
    text, end = ask(session, [user(PROMPT, picture)])
    assert text and end.images_encoded == 1


def test_cli_run_with_an_image(vl: VisionModel, folder: Path, pictures: list[Path]) -> None:
    res = run_cli("run", str(folder), PROMPT, "--image", str(pictures[0]), "--engine", "mlx",
                  "--temperature", "0", "-n", "8", "--ctx", "512", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["text"] == reference_greedy(vl, pictures[0], PROMPT, 8).text and out["images_encoded"] == 1
    shown = json.loads(run_cli("show", str(folder), "--json").stdout)
    assert "vision" in shown["capabilities"]


def test_models_that_read_no_images_say_why(models: Models, folder: Path, pictures: list[Path], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A text-only model refuses images, naming itself; a vision-language model whose family
    mlx-vlm does not know fails to load with its family named; one whose vision tower has no weights,
    or without mlx-vlm installed, runs as text (mlx-lm reads its language model) and refuses images,
    saying why and what to do."""
    from localrun.backends import mlx as mlx_backend

    request = Request.chat([user(PROMPT, pictures[0])])
    text_only = load(models.chat.mlx, "mlx")
    try:
        with pytest.raises(UsageError, match=r"'stories-chat-mlx(:latest)?' is a text-only model: it reads no images"):
            list(api.stream(text_only, request, GREEDY))
        assert ask(text_only, [{"role": "user", "content": "Once"}])[0]
    finally:
        text_only.close()

    odd = tmp_path / "odd-vl"
    odd.mkdir()
    for entry in folder.iterdir():
        (odd / entry.name).symlink_to(entry)
    config = json.loads((folder / "config.json").read_text())
    (odd / "config.json").unlink()
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "qwen9_vl"}))
    with pytest.raises(BadModelFileError, match=r"mlx-vlm \S+ does not support its family .*qwen9_vl"):
        mlx_backend.MLXBackend().load(ModelInfo("odd-vl", str(odd), "mlx", "path", 0), LoadOptions(n_ctx=256))

    # A folder whose weights lack the vision tower (a converter for text kept only the language model)
    import mlx.core as mx

    towerless = tmp_path / "towerless-vl"
    towerless.mkdir()
    for entry in folder.iterdir():
        if entry.suffix != ".safetensors" and entry.name != "model.safetensors.index.json":
            (towerless / entry.name).symlink_to(entry)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(towerless / "model.safetensors"),
                        {k: v for k, v in weights.items() if not k.startswith("vision_tower.")}, metadata={"format": "mlx"})
    engine = mlx_backend.MLXBackend().load(ModelInfo("towerless-vl", str(towerless), "mlx", "path", 0),
                                           LoadOptions(n_ctx=256))
    try:
        assert "no weights for its vision_tower" in engine.info()["warning"]
        with pytest.raises(UsageError, match=r"'towerless-vl' is a vision-language model, but mlx-vlm could not load "
                                             r"it .*no weights for its vision_tower.*: on MLX it reads text only"):
            engine.prompt_tokens(request, [])
    finally:
        engine.close()

    monkeypatch.setattr(mlx_backend, "vlm_installed", lambda: False)
    engine = mlx_backend.MLXBackend().load(ModelInfo("tiny-vl", str(folder), "mlx", "path", 0), LoadOptions(n_ctx=256))
    try:
        with pytest.raises(UsageError, match=r"'tiny-vl' is a vision-language model, but mlx-vlm, which reads its "
                                             r"images, is not installed: on MLX it reads text only") as e:
            engine.prompt_tokens(request, [])
        assert "localrun[mlx-vision]" in str(e.value.hint)
        assert engine.prompt_tokens(Request.chat([{"role": "user", "content": "Hi"}]), [])
    finally:
        engine.close()


# writes each image where the user turn's content puts it, as LLaVA's processor reads <image>
LLAVA_TEMPLATE = ("{% for message in messages %}{% for part in message['content'] %}"
                  "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
                  "{% endfor %}{% endfor %}")


def test_llava15_replies_as_transformers_does(tmp_path_factory: pytest.TempPathFactory) -> None:
    """LLaVA 1.5 as llava-hf publishes it (a CLIP tower, an MLP projector) through mlx-vlm in the
    engine loop: transformers' own greedy reply, token for token, to two images, with the prompt's
    16 image tokens counted. mlx-vlm's LLaVA processor passes the text settings (padding) to the
    image processor too, which transformers 5 refuses on every request; the engine lets the image
    processor see only its own settings (keep_image_kwargs)."""
    import torch
    import transformers as tf
    from PIL import Image

    from tests.vision_models import CLIP_SIDE, llava15_checkpoint

    root = tmp_path_factory.mktemp("llava15")
    model = llava15_checkpoint(root / "ckpt")
    processor = tf.AutoProcessor.from_pretrained(root / "ckpt")
    folder = mlx_vlm_folder(root / "ckpt")
    s = api.load(api.get_model(str(folder)), LoadOptions(n_ctx=512, n_parallel=1), engine="mlx")
    replies = []
    try:
        assert s.info()["vision"] == "mlx-vlm (llava)"
        for seed in (0, 1):
            picture = test_image(root / f"image{seed}.png", CLIP_SIDE, CLIP_SIDE, seed=seed)
            request = Request.chat([user(PROMPT, picture)])
            request = Request(**{**request.__dict__, "template": LLAVA_TEMPLATE})
            chunks = list(api.stream(s, request, GenerationParams(temperature=0, max_tokens=8, logprobs=0)))
            got = [bytes(lp.bytes) for c in chunks for lp in c.logprobs]
            with Image.open(picture) as file:
                inputs = processor(images=[file.convert("RGB")], text=f"<image>{PROMPT}", return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            pieces = processor.tokenizer.convert_ids_to_tokens(out.tolist())
            want = [bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("\u2581", " ").encode()
                    for p in pieces]
            assert got == want, seed
            assert b"".join(got) == "".join(c.text for c in chunks).encode()  # each token's piece of the text
            assert chunks[-1].prompt_tokens == inputs["input_ids"].shape[1] and chunks[-1].images_encoded == 1
            replies.append(got)
    finally:
        s.close()
    assert replies[0] != replies[1]  # the reply depends on the image


# each image where the user turn's content puts it, written as the family's processor reads it
PART_TEMPLATE = ("{% for message in messages %}{% for part in message['content'] %}"
                 "{% if part['type'] == 'image' %}IMAGE{% else %}{{ part['text'] }}{% endif %}"
                 "{% endfor %}{% endfor %}")
FAMILY_TEMPLATES = {"qwen2.5-vl": PART_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>"),
                    "gemma3": PART_TEMPLATE.replace("IMAGE", "<start_of_image>"),
                    "smolvlm": PART_TEMPLATE.replace("IMAGE", "<image>")}


def _family_reference(name: str, hf: Path, model: Any, template: str, picture: Path, n: int) -> tuple[list[bytes], int]:
    """transformers' greedy reply (each token's bytes) to one user turn [image, PROMPT] rendered with
    template, through the family's own processor; and the prompt's length."""
    import torch
    import transformers as tf
    from PIL import Image

    from tests.vision_models import IMAGE_PAD, _image_processor, _pixels, prompt_ids, token_bytes

    tok = tf.AutoTokenizer.from_pretrained(str(hf))
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    rendered = tok.apply_chat_template(turn, chat_template=template, tokenize=False, add_generation_prompt=True)
    if name == "qwen2.5-vl":  # Qwen2_5_VLProcessor insists on a video processor (torchvision): its image half
        pixels, grid, count = _pixels(_image_processor().from_pretrained(str(hf)), picture)
        ids = torch.tensor([prompt_ids(tok, rendered, count)])
        inputs = {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid,
                  "mm_token_type_ids": (ids == tok.convert_tokens_to_ids(IMAGE_PAD)).long()}
    else:
        with Image.open(picture) as file:
            rgb = file.convert("RGB")
        # transformers' class itself: mlx-vlm, once imported, answers AutoProcessor with its own port
        processor = (tf.Gemma3Processor if name == "gemma3" else tf.Idefics3Processor).from_pretrained(str(hf))
        inputs = dict(processor(images=[rgb], text=rendered, return_tensors="pt"))
        # Without token_type_ids transformers' Gemma 3 lets image tokens attend only backwards, as
        # mlx-vlm's does (with them, both ways, as llama.cpp's: tests/test_vision_families.py)
        inputs.pop("token_type_ids", None)
    prompt = inputs["input_ids"]
    inputs.setdefault("attention_mask", torch.ones_like(prompt))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return [token_bytes(tok, int(t)) for t in out[0, prompt.shape[1]:]], prompt.shape[1]


@pytest.mark.parametrize("name", ["qwen2.5-vl", "gemma3", "smolvlm"])
def test_qwen25vl_gemma3_and_smolvlm_reply_as_transformers_does(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The tiny Qwen2.5-VL, Gemma 3 (published layout) and SmolVLM of tests/vision_models.py through
    mlx-vlm in the engine loop: transformers' greedy reply through the family's own processor, token
    for token, with the prompt's tokens counted (SmolVLM's 112x112 image: 2x2 tiles and the
    overview); another image, another reply. mlx-vlm reads Gemma 3's settings where transformers 5
    does not write them (mm_tokens_per_image, sliding_window_pattern, and the width by whose root it
    divides the image features): the engine's config view writes them there. mlx-vlm's Gemma 3
    lets image tokens attend only backwards: the reference is transformers' so computed."""
    from tests.vision_models import FAMILIES

    build, (width, height) = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    hf = root / name
    hf.mkdir()
    model, _ = build(hf)
    template = FAMILY_TEMPLATES[name]  # (the Qwen2.5-VL checkpoint carries Qwen3's, which reads no image parts)
    s = api.load(api.get_model(str(mlx_vlm_folder(hf))), LoadOptions(n_ctx=1024, n_parallel=1), engine="mlx")
    replies = []
    try:
        for seed in (3, 4):
            picture = test_image(root / f"image{seed}.png", width, height, seed=seed)
            request = Request(**{**Request.chat([user(PROMPT, picture)]).__dict__, "template": template})
            chunks = list(api.stream(s, request, GenerationParams(temperature=0, max_tokens=8, logprobs=0)))
            got = [bytes(lp.bytes) for c in chunks for lp in c.logprobs]
            want, prompt_tokens = _family_reference(name, hf, model, template, picture, 8)
            assert got == want, seed
            assert chunks[-1].prompt_tokens == prompt_tokens and chunks[-1].images_encoded == 1
            replies.append(got)
    finally:
        s.close()
    assert replies[0] != replies[1]
