"""Qwen2.5-VL, Gemma 3 and SmolVLM (Idefics3) converted by localrun and run by the llama.cpp engine,
against transformers' forward pass on the same pixels: the image embeddings the projector computes
(F32: relative difference below 1e-3), the first reply token's log-probabilities (their top 5 in the
same order) and the greedy reply (token for token), at F32; at F16 the first token agrees.

Each family is a tiny random checkpoint built here in its published layout (a few layers, random
weights whose reply depends on the image), with the tokens its image format needs: Qwen3's
tokenizer and chat template (a thinking one, as Qwen3-VL's) for Qwen2.5-VL, the Llama 2 vocabulary
with the image tokens added for the other two. What each exercises: Qwen2.5-VL's windowed attention
(two windows, one partial) and M-RoPE positions; Gemma 3's image embeddings attending to each other
both ways (mtmd decodes them non-causally) beside sliding-window layers; SmolVLM's tiles, a 112x112
image cut into 2x2 tiles of 56 plus the whole image shrunk to one (the overview).

Images are at the projector's input size, so neither side resamples them, except SmolVLM's overview,
which both sides shrink with a Lanczos filter (mtmd's agrees with Pillow's to 2e-4 in embeddings).
transformers reads what the engine reads: the prompt's text tokens as mtmd wrote them (the image's
delimiters included), each image run replaced by the model's image token once per embedding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import convert
from localrun import api
from localrun.generation import Request, TokenLogprob
from localrun.settings import GenerationParams, LoadOptions
from tests.vision_models import (
    FAMILIES,
    IDEFICS3_TOKENS,
    TILE,
    idefics3_checkpoint,
    test_image,
    token_bytes,
)

PROMPT = "Describe this image."
TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"  # the image, then the text
N = 8  # greedy tokens compared


@dataclass(frozen=True)
class Family:
    """One tiny checkpoint: transformers' model and tokenizer, the model's image token, the test
    image, and our F32 and F16 conversions (each a text GGUF and its projector)."""

    name: str
    hf: Path
    model: Any
    tok: Any
    image_token: int
    image: Path
    f32: convert.Result
    f16: convert.Result


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    import transformers as tf

    name = request.param
    build, (width, height) = FAMILIES[name]
    root = tmp_path_factory.mktemp(name)
    hf = root / name
    hf.mkdir()
    model, image_token = build(hf)
    f32 = convert.convert(hf, root / f"{name}-f32.gguf", outtype="f32")
    f16 = convert.convert(hf, root / f"{name}-f16.gguf", outtype="f16")
    tok = tf.AutoTokenizer.from_pretrained(str(hf))
    image = test_image(root / "image.png", width, height, seed=3)
    return Family(name, hf, model, tok, image_token, image, f32, f16)


# --- the engine's side ----------------------------------------------------------------------------


@contextmanager
def session_of(ours: convert.Result) -> Iterator[Any]:
    """Our converted pair loaded in an engine process (one sequence), closed after."""
    assert ours.mmproj is not None
    session = api.load(api.get_model(str(ours.path)), LoadOptions(n_ctx=1024, n_parallel=1, mmproj=str(ours.mmproj.path)))
    try:
        yield session
    finally:
        session.close()


def ask(session: Any, images: list[bytes], text: str = PROMPT, max_tokens: int = 4,
        history: tuple[dict[str, Any], ...] = ()) -> list[Any]:
    """The chunks of a greedy reply to one user turn [images, text] after history."""
    turn = {"role": "user", "content": text, "images": images}
    return list(api.stream(session, Request.chat([*history, turn]), GenerationParams(temperature=0, max_tokens=max_tokens)))


@dataclass
class EngineSide:
    prompt: list[int | tuple[int, int]]  # text tokens, and (image key, embeddings) for each image run
    embeddings: list[Any]  # each run's image embeddings (embeddings x text width, F32)
    first: TokenLogprob  # the first reply token, with its top 5
    reply: list[bytes]  # the greedy reply, token by token


def engine_side(ours: convert.Result, image: Path, embeddings: bool = True) -> EngineSide:
    from localrun.backends.llama_cpp import LlamaCppEngine
    from localrun.backends.llama_vision import image_key
    from localrun.backends.loop import EngineLoop
    from tests.test_engine_loop import Record, run_until

    assert ours.mmproj is not None
    # Flash attention off: on the CPU its F16 keys and values alone differ by about 1e-3.
    engine = LlamaCppEngine(api.get_model(str(ours.path)),
                            LoadOptions(n_ctx=1024, n_parallel=1, mmproj=str(ours.mmproj.path), flash_attn=False))
    try:
        vision = engine.vision
        assert vision is not None
        request = dataclasses.replace(
            Request.chat([{"role": "user", "content": PROMPT, "images": [image.read_bytes()]}]), template=TEMPLATE)
        tokens = engine.prompt_tokens(request, [])
        prompt: list[int | tuple[int, int]] = []
        found = []
        for t in tokens:
            if t >= 0:
                prompt.append(t)
                continue
            key, i = image_key(t)
            if i == 0:
                chunk, _ = vision.chunks[key]
                n = vision.mt.mtmd_input_chunk_get_n_tokens(chunk)
                prompt.append((key, n))
                if embeddings:
                    assert vision.mt.mtmd_encode_chunk(vision.ctx, chunk) == 0
                    out = vision.mt.mtmd_get_output_embd(vision.ctx)
                    found.append(np.ctypeslib.as_array(out, shape=(n, vision.n_embd)).copy())
        rec = Record()
        loop = EngineLoop(engine, rec)
        loop.submit("x", request, GenerationParams(temperature=0, max_tokens=N, logprobs=5))
        run_until(loop, lambda: rec.final("x") is not None)
        lps = rec.logprobs["x"]
        return EngineSide(prompt, found, lps[0], [bytes(lp.bytes) for lp in lps])
    finally:
        engine.close()


# --- transformers' side ---------------------------------------------------------------------------


def _rgb(path: Path) -> Any:
    from PIL import Image

    with Image.open(path) as file:
        return file.convert("RGB")


def _normalized(rgb: Any) -> Any:
    """SigLIP's input: [3, H, W] F32, scaled to [-1, 1] (mean and std 0.5)."""
    import torch

    return (torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1) - 0.5) / 0.5


def hf_inputs(fam: Family, eng: EngineSide) -> tuple[Any, dict[str, Any]]:
    """transformers' input ids for what the engine read, and the family's image arguments."""
    import torch

    ids: list[int] = []
    for item in eng.prompt:
        ids.extend([fam.image_token] * item[1] if isinstance(item, tuple) else [item])
    input_ids = torch.tensor([ids])
    mask = (input_ids == fam.image_token).long()
    if fam.name == "qwen2.5-vl":
        from tests.vision_models import _image_processor, _pixels

        pixels, grid, _ = _pixels(_image_processor().from_pretrained(str(fam.hf)), fam.image)
        return input_ids, {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": mask}
    rgb = _rgb(fam.image)
    if fam.name == "gemma3":
        return input_ids, {"pixel_values": _normalized(rgb)[None], "token_type_ids": mask}
    # SmolVLM: mtmd's order, the tiles row by row, then the overview (Lanczos, as both sides shrink it)
    from PIL import Image

    tiles = [rgb.crop((x, y, x + TILE, y + TILE)) for y in range(0, rgb.height, TILE) for x in range(0, rgb.width, TILE)]
    frames = [*tiles, rgb.resize((TILE, TILE), Image.Resampling.LANCZOS)]
    runs = sum(isinstance(item, tuple) for item in eng.prompt)
    assert len(frames) == runs, (len(frames), runs)
    pixels = torch.stack([_normalized(f) for f in frames])[None]
    return input_ids, {"pixel_values": pixels, "pixel_attention_mask": torch.ones(pixels.shape[:2] + pixels.shape[3:],
                                                                                  dtype=torch.bool)}


def hf_image_embeddings(fam: Family, args: dict[str, Any]) -> Any:
    import torch

    inner = fam.model.model
    with torch.no_grad():
        if fam.name == "qwen2.5-vl":
            out = inner.get_image_features(args["pixel_values"], args["image_grid_thw"]).pooler_output
        elif fam.name == "gemma3":
            out = inner.get_image_features(args["pixel_values"]).pooler_output
        else:
            out = inner.get_image_features(args["pixel_values"], args["pixel_attention_mask"]).pooler_output
    if isinstance(out, (tuple, list)):
        out = torch.cat(list(out))
    return out.reshape(-1, out.shape[-1]).float().numpy()


def hf_greedy(fam: Family, input_ids: Any, args: dict[str, Any], n: int) -> tuple[Any, list[int]]:
    """The first step's log-probabilities and n greedy tokens (full forward passes, no cache)."""
    import torch

    tokens: list[int] = []
    first = None
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([input_ids, torch.tensor([tokens], dtype=torch.long)], 1) if tokens else input_ids
            extra = dict(args)
            for key in ("mm_token_type_ids", "token_type_ids"):
                if key in extra:
                    extra[key] = (ids == fam.image_token).long()
            logits = fam.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **extra).logits[0, -1]
            if first is None:
                first = torch.log_softmax(logits.double(), -1)
            tokens.append(int(logits.argmax()))
    return first, tokens


def test_image_embeddings_first_log_probs_and_greedy_replies_agree_with_transformers(family: Family,
                                                                                     tmp_path: Path) -> None:
    """F32: each image run's embeddings within 6e-4 of transformers' (SmolVLM: each tile and the
    overview; measured: at most 3.5e-4), the first token's top 5 in the same order and within
    0.006 in log-probability (measured: at most 0.0032), the same greedy reply; another image
    gives another reply (the image is in use)."""
    import torch

    eng = engine_side(family.f32, family.image)
    input_ids, args = hf_inputs(family, eng)
    want = hf_image_embeddings(family, args)
    got = np.concatenate(eng.embeddings)
    assert got.shape == want.shape
    runs = np.split(want, np.cumsum([len(e) for e in eng.embeddings])[:-1])
    rel = [float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(eng.embeddings, runs, strict=True)]
    print(family.name, "image embeddings: relative difference of each run", rel)
    assert max(rel) < 6e-4
    first, tokens = hf_greedy(family, input_ids, args, N)
    top = torch.topk(first, 5)
    assert [bytes(t.bytes) for t in eng.first.top] == [token_bytes(family.tok, int(i)) for i in top.indices]
    diff = float(np.abs(np.array([t.logprob for t in eng.first.top]) - top.values.numpy()).max())
    print(family.name, "first token's top-5 log-probabilities: largest difference", diff)
    assert diff < 0.006
    assert eng.reply == [token_bytes(family.tok, t) for t in tokens]
    width, height = FAMILIES[family.name][1]
    other = engine_side(family.f32, test_image(tmp_path / "other.png", width, height, seed=4), embeddings=False)
    assert other.reply != eng.reply


def test_an_f16_conversion_picks_transformers_first_token(family: Family) -> None:
    eng = engine_side(family.f16, family.image, embeddings=False)
    input_ids, args = hf_inputs(family, eng)
    first, _ = hf_greedy(family, input_ids, args, 1)
    assert bytes(eng.first.top[0].bytes) == token_bytes(family.tok, int(first.argmax()))


@pytest.mark.parametrize("family", ["smolvlm"], indirect=True)
def test_a_tiled_image_counts_once_and_the_next_turn_encodes_none_of_its_tiles(family: Family) -> None:
    """SmolVLM's 112x112 image is 2x2 tiles and an overview, five chunks of one image: five
    different runs of embeddings (each tile its own), one image encoded, none on the next turn."""
    eng = engine_side(family.f32, family.image)
    keys = [item[0] for item in eng.prompt if isinstance(item, tuple)]
    assert len(keys) == len(set(keys)) == 5
    image = [family.image.read_bytes()]
    with session_of(family.f32) as session:
        first = ask(session, image)
        turn = ({"role": "user", "content": PROMPT, "images": image},
                {"role": "assistant", "content": "".join(c.text for c in first)})
        again = ask(session, [], "And the colours?", history=turn)
    assert again[-1].cached_tokens >= first[-1].prompt_tokens
    assert (first[-1].images_encoded, again[-1].images_encoded) == (1, 0)


@pytest.mark.parametrize("family", ["smolvlm"], indirect=True)
def test_a_request_with_more_tiles_than_images_kept_is_answered(family: Family, tmp_path: Path) -> None:
    """13 different tiled images in one message are 65 chunks, more than the 64 images the engine
    keeps tokenized until their prefill: it keeps images, each with all its tiles."""
    from localrun.backends.llama_vision import KEEP_IMAGES

    pictures = [test_image(tmp_path / f"{seed}.png", 2 * TILE, 2 * TILE, seed=seed).read_bytes() for seed in range(13)]
    assert 5 * len(pictures) > KEEP_IMAGES
    with session_of(family.f32) as session:
        assert ask(session, pictures, max_tokens=2)[-1].images_encoded == 13


@pytest.mark.parametrize("family", ["qwen2.5-vl"], indirect=True)
def test_a_thinking_models_short_question_after_an_image(family: Family) -> None:
    """This checkpoint carries Qwen3's chat template, a thinking one, as Qwen3-VL does: the engine
    reads the prompt's last tokens to see whether a thought is open, and an image there has no text
    (its placeholders are no vocabulary ids: reading them aborted the process)."""
    assert api.reasoning_format(api.get_model(str(family.f32.path))) is not None
    with session_of(family.f32) as session:
        chunks = ask(session, [family.image.read_bytes()], "Hi")
    assert chunks[-1].images_encoded == 1 and chunks[-1].completion_tokens == 4


def test_a_projector_whose_delimiters_the_vocabulary_lacks_fails_its_request_by_name(tmp_path: Path) -> None:
    r"""SmolVLM's projector has mtmd put "\n\n", <fake_token_around_image> and <global-img> around
    the overview, each one token of the model's vocabulary. A vocabulary without one (here "\n\n")
    is a model and projector that do not belong together: the request fails saying so, instead of
    decoding a token id that is not one."""
    from localrun.errors import BadModelFileError

    hf = tmp_path / "smolvlm"
    hf.mkdir()
    idefics3_checkpoint(hf, IDEFICS3_TOKENS[:-1])
    image = test_image(tmp_path / "image.png", TILE, TILE)
    with session_of(convert.convert(hf, tmp_path / "m.gguf", outtype="f16")) as session, \
            pytest.raises(BadModelFileError, match="image delimiters that this model's vocabulary does not have"):
        ask(session, [image.read_bytes()])
