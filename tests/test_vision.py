"""Images on the llama.cpp engine: a tiny Qwen2-VL converted by llama.cpp's own converter (text
GGUF + projector), against transformers' forward pass on the same pixels, through the engine
loop, the CLI and the store."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.errors import UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo
from tests.conftest import run_cli, serve_command
from tests.vision_models import VisionModel, qwen2vl, reference_greedy, test_image

PROMPT = "Describe this image."
GREEDY = GenerationParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def vl() -> VisionModel:
    return qwen2vl("f32")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("pictures")
    return [test_image(root / f"image{seed}.png", seed=seed) for seed in (0, 1)]


def info(model: VisionModel) -> ModelInfo:
    return api.get_model(str(model.gguf))


def ask(session: Any, messages: list[dict[str, Any]], params: GenerationParams = GREEDY) -> tuple[str, Any]:
    chunks = list(api.stream(session, Request.chat(messages), params))
    return "".join(c.text for c in chunks), chunks[-1]


def user(text: str, *images: Path) -> dict[str, Any]:
    return {"role": "user", "content": text, "images": [p.read_bytes() for p in images]}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_greedy_replies_equal_transformers_on_the_same_pixels(dtype: str, pictures: list[Path]) -> None:
    """The image goes through mtmd_tokenize and is evaluated inside the engine loop; the reply is
    transformers' own greedy continuation (F32 reference; both image tokens and text positions of
    this M-RoPE model), and another image gives another reply."""
    model = qwen2vl(dtype)
    session = api.load(info(model), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(model.mmproj)))
    try:
        assert session.info()["mmproj"] == str(model.mmproj)
        replies = []
        for picture in pictures:
            ref = reference_greedy(model, picture, PROMPT, 8)
            text, end = ask(session, [user(PROMPT, picture)])
            assert text == ref.text, (dtype, picture.name)
            # The prompt fills 25 text tokens + 12 image embeddings of KV cells (in 29 positions: M-RoPE),
            # as transformers counts its prompt ids.
            assert end.prompt_tokens == len(ref.prompt_ids) == 37 and end.images_encoded == 1
            replies.append(text)
        assert replies[0] != replies[1]
    finally:
        session.close()


def test_the_next_turn_finds_its_image_in_the_kv_cache(vl: VisionModel, pictures: list[Path]) -> None:
    """The second turn of a conversation reuses the first turn's KV cache, image included: no image
    is encoded again, and the reply is what a fresh engine gives the whole conversation."""
    session = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj)))
    try:
        first, end1 = ask(session, [user(PROMPT, pictures[0])])
        assert end1.images_encoded == 1
        conversation = [user(PROMPT, pictures[0]), {"role": "assistant", "content": first},
                        {"role": "user", "content": "And the colours?"}]
        second, end2 = ask(session, conversation)
        assert end2.images_encoded == 0 and end2.cached_tokens >= end1.prompt_tokens
        # A different image in the same place is not taken for the cached one.
        other, end3 = ask(session, [user(PROMPT, pictures[1])])
        assert end3.images_encoded == 1 and other != first
    finally:
        session.close()
    fresh = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj)))
    try:
        again, end = ask(fresh, conversation)
        assert again == second and end.images_encoded == 1 and end.cached_tokens == 0
    finally:
        fresh.close()


def test_an_image_no_longer_in_the_kv_cache_is_decoded_from_its_kept_embeddings(vl: VisionModel,
                                                                                pictures: list[Path]) -> None:
    """The engine keeps encoded images' embeddings by digest: the first image asked about again
    after another image took the only slot is decoded again without being encoded, and the reply
    is the same."""
    session = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj)))
    try:
        first, end1 = ask(session, [user(PROMPT, pictures[0])])
        other, end2 = ask(session, [user(PROMPT, pictures[1])])
        assert (end1.images_encoded, end2.images_encoded) == (1, 1) and other != first
        again, end3 = ask(session, [user(PROMPT, pictures[0])])
        assert end3.cached_tokens < end3.prompt_tokens - 10  # the slot held the other image: not a KV cache hit
        assert again == first and end3.images_encoded == 0
    finally:
        session.close()


def test_image_requests_decode_beside_text_requests(vl: VisionModel, pictures: list[Path]) -> None:
    """Three requests at once (two images, one text) in one engine loop: each reply is the one it
    gets alone."""
    asks = [[user(PROMPT, pictures[0])], [user(PROMPT, pictures[1])], [{"role": "user", "content": "Tell me a story."}]]
    params = GenerationParams(temperature=0, max_tokens=24)
    solo = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj)))
    try:
        alone = [ask(solo, m, params)[0] for m in asks]
    finally:
        solo.close()
    session = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=3, mmproj=str(vl.mmproj)))
    try:
        with ThreadPoolExecutor(3) as pool:  # each request from its own thread, as a server's clients
            together = list(pool.map(lambda m: ask(session, m, params)[0], asks))
    finally:
        session.close()
    assert together == alone


def test_bad_images_fail_their_own_request_and_the_engine_goes_on(vl: VisionModel, pictures: list[Path]) -> None:
    from tests.test_images import bomb

    session = api.load(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj)))
    try:
        whole = pictures[0].read_bytes()
        truncated = whole[: len(whole) // 2]  # the header says 112x84; the pixels stop half way
        with pytest.raises(UsageError, match="image 1 of the request could not be decoded"):
            ask(session, [{"role": "user", "content": PROMPT, "images": [truncated]}])
        with pytest.raises(UsageError, match="30000x30000 pixels, more than localrun decodes"):
            ask(session, [{"role": "user", "content": PROMPT, "images": [bomb()]}])
        with pytest.raises(UsageError, match="is not an image localrun can read"):
            ask(session, [{"role": "user", "content": PROMPT, "images": [b"GIF87a"]}])
        with pytest.raises(UsageError, match="'<__media__>', which marks an image"):
            ask(session, [user("look: <__media__>", pictures[0])])
        text, end = ask(session, [user(PROMPT, pictures[0])])
        assert text and end.images_encoded == 1
    finally:
        session.close()


def test_a_model_without_a_projector_refuses_images(starter: Path, pictures: list[Path]) -> None:
    session = api.load("smollm2:135m", LoadOptions(n_ctx=512, n_parallel=1))
    try:
        with pytest.raises(UsageError, match=r"'smollm2:135m' does not support images"):
            ask(session, [user("What is it?", pictures[0])])
        assert ask(session, [{"role": "user", "content": "What is the opposite of hot?"}])[0]
    finally:
        session.close()


def test_cli_add_list_show_run_and_a_missing_projector(vl: VisionModel, pictures: list[Path], tmp_path: Path) -> None:
    """`add --mmproj` keeps the projector with the model; `list` and `show` say so; `run --image`
    (also from stdin) answers as the engine does; a projector gone leaves a text model with one warning."""
    gguf, mmproj = tmp_path / "vl.gguf", tmp_path / "mmproj-vl.gguf"
    os.link(vl.gguf, gguf) if vl.gguf.stat().st_dev == tmp_path.stat().st_dev else shutil.copy(vl.gguf, gguf)
    shutil.copy(vl.mmproj, mmproj)
    res = run_cli("add", str(gguf), "--name", "vl:tiny", "--mmproj", str(mmproj), "--json")
    assert res.returncode == 0, res.stderr
    res = run_cli("add", str(gguf), "--name", "vl:bad", "--mmproj", str(gguf))
    assert res.returncode != 0 and "is not a vision projector (its architecture is qwen2vl)" in res.stderr
    listing = run_cli("list").stdout
    assert any(line.startswith("vl:tiny") and line.rstrip().endswith("vision") for line in listing.splitlines()), listing
    shown = run_cli("show", "vl:tiny").stdout
    assert f"projector       {mmproj}" in shown and "vision" in shown.split("capabilities", 1)[1].splitlines()[0]
    assert "vision" in json.loads(run_cli("show", "vl:tiny", "--json").stdout)["capabilities"]
    ref = reference_greedy(vl, pictures[0], PROMPT, 8)
    res = run_cli("run", "vl:tiny", PROMPT, "--image", str(pictures[0]), "--temperature", "0", "-n", "8",
                  "--ctx", "512", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["text"] == ref.text and out["images_encoded"] == 1
    piped = subprocess.run([sys.executable, "-m", "localrun", "run", "vl:tiny", PROMPT, "--image", "-",
                            "--temperature", "0", "-n", "8", "--ctx", "512"],
                           input=pictures[0].read_bytes(), capture_output=True, timeout=300)
    assert piped.returncode == 0 and piped.stdout.decode().rstrip("\n") == ref.text.rstrip("\n")
    res = run_cli("run", "vl:tiny", PROMPT, "--image", str(tmp_path / "nope.png"))
    assert res.returncode != 0 and "nope.png': no such file" in res.stderr
    mmproj.unlink()
    assert "vision projector missing" in run_cli("list").stdout
    res = run_cli("run", "vl:tiny", "Hello", "--temperature", "0", "-n", "4", "--ctx", "512")
    assert res.returncode == 0 and res.stderr.count("warning") == 1
    assert "its vision projector" in res.stderr and "is missing: it reads no images" in res.stderr
    assert "vision" not in json.loads(run_cli("show", "vl:tiny", "--json").stdout)["capabilities"]
    _served_warns_once(res.stderr.strip())
    res = run_cli("run", "vl:tiny", PROMPT, "--image", str(pictures[0]), "--ctx", "512")
    assert res.returncode != 0 and "'vl:tiny' does not support images (its vision projector" in res.stderr


def _served_warns_once(warning: str) -> None:
    """`localrun serve` says the engine's warning about a model in its log when it loads it, once
    however often the model loads again (here after unloading it with keep_alive 0)."""
    import ollama

    with serve_command("--ctx", "512", "--parallel", "1") as (url, stopped):
        client = ollama.Client(host=url, timeout=300)
        for _ in range(2):
            reply = client.generate(model="vl:tiny", prompt="Hello", keep_alive=0, options={"num_predict": 2})
            assert reply.done
    assert stopped.err.count("warning") == 1 and warning in stopped.err, stopped.err


def test_batch_rows_take_image_paths_and_data_uris(vl: VisionModel, pictures: list[Path], tmp_path: Path) -> None:
    shutil.copy(pictures[0], tmp_path / "a.png")
    uri = "data:image/png;base64," + base64.b64encode(pictures[1].read_bytes()).decode()
    rows = [{"id": "a", "prompt": PROMPT, "images": ["a.png"]},
            {"id": "b", "prompt": PROMPT, "images": [uri]},
            {"id": "c", "messages": [{"role": "user", "content": PROMPT, "images": ["a.png"]}]},
            {"id": "d", "prompt": PROMPT, "images": ["missing.png"]},
            {"id": "e", "prompt": PROMPT, "images": [uri.split(",", 1)[1]]}]  # plain base64, as Ollama sends it
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    res = run_cli("batch", str(vl.gguf), "--input", str(src), "--output", str(out), "--mmproj", str(vl.mmproj),
                  "--temperature", "0", "--max-tokens", "8", "--ctx", "512")
    assert res.returncode == 1 and "5 rows (4 ok, 1 failed)" in res.stderr  # a failed row fails the run, not the others
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    refs = [reference_greedy(vl, p, PROMPT, 8).text for p in pictures]
    assert got["a"]["text"] == refs[0] and got["c"]["text"] == refs[0] and got["b"]["text"] == refs[1]
    assert got["e"]["text"] == refs[1]
    assert "no such file" in got["d"]["error"]


def test_interactive_chat_attaches_an_image_and_keeps_it_in_the_history(vl: VisionModel, pictures: list[Path]) -> None:
    """`/image PATH` in `localrun run`'s chat: the next message carries it, the reply is the
    engine's for that image, and the next turn finds it in the cache (no image encoded). A path
    alone on the line, quoted as a terminal pastes a dropped file, attaches that image too."""
    from tests.test_cli import Terminal, _turn

    ref = reference_greedy(vl, pictures[0], PROMPT, 8)
    term = Terminal("run", str(vl.gguf), "--mmproj", str(vl.mmproj), "--temperature", "0", "-n", "8", "--ctx", "512",
                    "--verbose")
    term.expect(">>> ")
    start = len(term.out)
    term.send(f"/image {pictures[0]}\r")
    term.expect("attached to your next message", start=start)
    assert f"[image {pictures[0].name}: PNG 112x84, " in term.out[start:].decode()
    term.expect(">>> ", start=start + 10)
    term.send(f"/image {pictures[0].parent / 'nope.png'}\r")
    term.expect("no such file", start=start)
    term.expect(">>> ", start=term.out.rindex(b"no such file"))
    first, p1, _ = _turn(term, PROMPT)
    assert ref.text.strip() in first.replace("\r\n", "\n") and "1 image encoded" in first
    second, p2, _ = _turn(term, "And the colours?")
    assert p2 > p1 and "image encoded" not in second
    start = len(term.out)
    term.send(f"'{pictures[1]}'\r")
    term.expect("attached to your next message", start=start)
    assert f"[image {pictures[1].name}: PNG 112x84, " in term.out[start:].decode()
    term.expect(">>> ", start=start + 10)
    third, _, _ = _turn(term, "And this one?")
    assert "1 image encoded" in third
    term.send("\x04")
    assert term.wait() == 0


def test_image_embeddings_and_first_log_probs_agree_with_transformers(vl: VisionModel, pictures: list[Path]) -> None:
    """What the engine's projector computes for an image equals transformers' vision tower and
    merger on the same pixels (F32: relative difference below 1e-3), and the first reply token's
    log-probabilities agree (their top 5 in the same order)."""
    import numpy as np
    import torch

    from localrun.backends.llama_cpp import LlamaCppEngine
    from localrun.backends.llama_vision import image_key
    from localrun.backends.loop import EngineLoop
    from tests.test_engine_loop import Record, run_until
    from tests.vision_models import _loaded, _pixels, reference_image_embeddings

    # Flash attention off: on the CPU its F16 keys and values alone differ by about 1e-3.
    engine = LlamaCppEngine(info(vl), LoadOptions(n_ctx=512, n_parallel=1, mmproj=str(vl.mmproj), flash_attn=False))
    try:
        vision = engine.vision
        assert vision is not None
        request = Request.chat([user(PROMPT, pictures[0])])
        tokens = engine.prompt_tokens(request, [])
        chunk, n_pos = vision.chunks[image_key(min(tokens))[0]]
        assert vision.mt.mtmd_encode_chunk(vision.ctx, chunk) == 0
        n = vision.mt.mtmd_input_chunk_get_n_tokens(chunk)
        got = np.ctypeslib.as_array(vision.mt.mtmd_get_output_embd(vision.ctx), shape=(n * engine.info()["n_embd"],))
        want = reference_image_embeddings(vl, pictures[0])
        got = got.reshape(want.shape).copy()
        assert (n, n_pos) == (12, 4)
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        print("image embeddings: relative difference", rel)
        assert rel < 1e-3
        rec = Record()
        loop = EngineLoop(engine, rec)
        loop.submit("x", request, GenerationParams(temperature=0, max_tokens=1, logprobs=5))
        run_until(loop, lambda: rec.final("x") is not None)
        first = rec.logprobs["x"][0]
    finally:
        engine.close()
    model, tok, processor = _loaded(str(vl.hf))
    pixels, grid, _ = _pixels(processor, pictures[0])
    ids = torch.tensor([reference_greedy(vl, pictures[0], PROMPT, 1).prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=(ids == tok.convert_tokens_to_ids("<|image_pad|>")).long()).logits[0, -1]
    logp = torch.log_softmax(logits.double(), -1)
    top = torch.topk(logp, 5)
    assert [t.token for t in first.top] == [tok.decode([int(i)]) for i in top.indices]
    mine = np.array([t.logprob for t in first.top])
    print("first token's top-5 log-probabilities: largest difference", float(np.abs(mine - top.values.numpy()).max()))
    assert float(np.abs(mine - top.values.numpy()).max()) < 0.05, (mine, top.values)
