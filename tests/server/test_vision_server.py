"""Images through `localrun serve` with the official clients: Ollama `images` on /api/chat and
/api/generate, OpenAI `image_url` parts (data URIs; file:// under --media-dir; http(s) only with
--allow-fetch), /api/show's `vision`; replies equal transformers' on the same pixels."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from localrun import api
from localrun.settings import LoadOptions
from tests.vision_models import VisionModel, qwen2vl, reference_greedy, test_image

from .conftest import MODEL, Served, serve

VL = "vl:tiny"
PROMPT = "Describe this image."


@pytest.fixture(scope="module")
def vl() -> VisionModel:
    return qwen2vl("f32")


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("media")
    return [test_image(root / f"image{seed}.png", seed=seed) for seed in (0, 1)]


@pytest.fixture(scope="module")
def refs(vl: VisionModel, pictures: list[Path]) -> list[str]:
    return [reference_greedy(vl, p, PROMPT, 8).text for p in pictures]


@pytest.fixture
def vserved(vl: VisionModel, pictures: list[Path]) -> Iterator[Served]:
    api.add_model(str(vl.gguf), name=VL, mmproj=str(vl.mmproj))
    with serve(LoadOptions(n_ctx=512, n_parallel=2), media_dir=str(pictures[0].parent.resolve())) as s:
        yield s


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_ollama_client_images_on_chat_and_generate(vserved: Served, pictures: list[Path], refs: list[str]) -> None:
    client = vserved.ollama()
    options = {"temperature": 0, "num_predict": 8}
    for picture, ref in zip(pictures, refs, strict=True):
        reply = client.chat(model=VL, messages=[{"role": "user", "content": PROMPT, "images": [str(picture)]}],
                            options=options)
        assert reply.message.content == ref
    streamed = "".join(part.message.content for part in client.chat(
        model=VL, messages=[{"role": "user", "content": PROMPT, "images": [pictures[1].read_bytes()]}],
        options=options, stream=True))
    assert streamed == refs[1]
    assert client.generate(model=VL, prompt=PROMPT, images=[pictures[0]], options=options).response == refs[0]
    caps = client.show(VL).capabilities or []
    assert "vision" in caps and "vision" not in (client.show(MODEL).capabilities or [])


def test_openai_client_image_parts_and_the_next_turn_reuses_the_cache(vserved: Served, pictures: list[Path],
                                                                      refs: list[str]) -> None:
    client = vserved.openai()

    def turn(*messages: dict) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=VL, messages=list(messages), temperature=0, max_tokens=8)

    first_user = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(pictures[0])}},
                                              {"type": "text", "text": PROMPT}]}
    first = turn(first_user)
    assert first.choices[0].message.content == refs[0]
    second = turn(first_user, {"role": "assistant", "content": refs[0]}, {"role": "user", "content": "And the colours?"})
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # file:// inside --media-dir is read; outside it is refused
    by_file = turn({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": pictures[1].resolve().as_uri()}}, {"type": "text", "text": PROMPT}]})
    assert by_file.choices[0].message.content == refs[1]
    with pytest.raises(openai.BadRequestError, match="is outside the server's --media-dir"):
        turn({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/hostname"}}]})
    with pytest.raises(openai.BadRequestError, match="message 0: image 1 is 30000x30000 pixels"):
        from tests.test_images import bomb

        turn({"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(bomb()).decode()}}]})
    # the server is still serving
    assert turn(first_user).choices[0].message.content == refs[0]


def test_http_image_urls_are_fetched_only_with_allow_fetch(vl: VisionModel, pictures: list[Path],
                                                            refs: list[str]) -> None:
    folder = str(pictures[0].parent)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a: object, **kw: object) -> None:
            super().__init__(*a, directory=folder, **kw)  # type: ignore[arg-type]

        def log_message(self, *args: object) -> None:
            pass

    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{files.server_address[1]}/{pictures[1].name}"
    api.add_model(str(vl.gguf), name=VL, mmproj=str(vl.mmproj))
    try:
        with serve(LoadOptions(n_ctx=512, n_parallel=1), allow_fetch=True) as s:
            reply = s.openai().chat.completions.create(model=VL, temperature=0, max_tokens=8, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": PROMPT}]}])
            assert reply.choices[0].message.content == refs[1]
            with pytest.raises(openai.BadRequestError, match="could not be fetched"):
                s.openai().chat.completions.create(model=VL, max_tokens=8, messages=[
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url + ".missing"}}]}])
    finally:
        files.shutdown()


def test_images_on_the_responses_and_messages_apis(vserved: Served, pictures: list[Path], refs: list[str]) -> None:
    """An input_image part (Responses) and an image block (Messages, base64 and url) give the
    replies transformers gives for the same pixels."""
    import anthropic

    responses = vserved.openai().responses
    for picture, ref in zip(pictures, refs, strict=True):
        reply = responses.create(model=VL, temperature=0, max_output_tokens=8, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_uri(picture)}, {"type": "input_text", "text": PROMPT}]}])
        assert reply.output_text == ref
    messages = anthropic.Anthropic(base_url=vserved.url, api_key="unused", max_retries=0).messages
    encoded = base64.b64encode(pictures[1].read_bytes()).decode()
    for source in ({"type": "base64", "media_type": "image/png", "data": encoded},
                   {"type": "url", "url": pictures[1].resolve().as_uri()}):
        reply = messages.create(model=VL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
            {"type": "image", "source": source}, {"type": "text", "text": PROMPT}]}])
        assert reply.content[0].text == refs[1]
    with pytest.raises(anthropic.BadRequestError, match="does not support images"):
        messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": encoded}}]}])
