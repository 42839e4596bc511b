"""The OpenAI API through openai-python, as its users call it: chat and text completions
(streamed and not, sync and async), usage, logprobs, models, embeddings, and its error types."""

from __future__ import annotations

import asyncio
import base64
import math
from pathlib import Path

import openai
import pytest

from .conftest import MODEL, Served

CHAT = [{"role": "user", "content": "What is the opposite of hot?"}]


def _norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def test_chat_completion_and_its_stream_agree(served: Served) -> None:
    client = served.openai()
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert choice.message.role == "assistant" and "cold" in choice.message.content.lower()
    assert choice.finish_reason in ("stop", "length")
    assert 0 < whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    # include_usage: one last chunk with no choices and the usage; the others carry none.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert served.records.wait(lambda r: r.path == "/v1/chat/completions" and r.status == 200).model == MODEL


def test_stream_without_usage_ends_with_done(served: Served) -> None:
    with served.http() as http:
        res = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                      "temperature": 0, "stream": True})
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
    events = [line for line in res.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1]) and '"usage"' not in res.text


def test_async_client_streams_and_completes(served: Served) -> None:
    async def main() -> tuple[str, str]:
        async with served.async_openai() as client:
            whole = await client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8)
            stream = await client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=8,
                                                          stream=True)
            parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return whole.choices[0].message.content, "".join(parts)

    whole, streamed = asyncio.run(main())
    assert whole and whole == streamed


def test_text_completion_raw_prompt(served: Served) -> None:
    client = served.openai()
    res = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3)
    assert res.object == "text_completion"
    assert res.choices[0].text.startswith(" Paris") and res.choices[0].finish_reason == "length"
    assert res.usage.prompt_tokens == 5 and res.usage.completion_tokens == 3
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                         max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == res.choices[0].text
    echo = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
                                     echo=True)
    assert echo.choices[0].text == "The capital of France is" + res.choices[0].text


def test_n_choices_and_prompt_lists(served: Served) -> None:
    client = served.openai()
    res = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=3, seed=7, temperature=1.5)
    assert [c.index for c in res.choices] == [0, 1, 2]
    one = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, seed=7, temperature=1.5)
    assert res.choices[0].message.content == one.choices[0].message.content  # choice 0 keeps the seed
    assert res.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert 3 <= res.usage.completion_tokens <= 18  # the three replies together
    many = client.completions.create(model=MODEL, prompt=["The capital of France is", "One, two,"], temperature=0,
                                     max_tokens=2, n=2)
    assert len(many.choices) == 4
    assert many.choices[0].text == many.choices[1].text and many.choices[0].text.startswith(" Paris")
    assert many.choices[2].text == many.choices[3].text != many.choices[0].text


def test_logprobs(served: Served) -> None:
    client = served.openai()
    res = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                         top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens
    assert "".join(t.token for t in content) == res.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.logprob >= max(a.logprob for a in t.top_logprobs) - 1e-4  # greedy took the most likely
        assert bytes(t.bytes).decode("utf-8", errors="replace")
    text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=3,
                                     logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == 3 and "".join(lp.tokens) == text.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(d) == 2 for d in lp.top_logprobs)


def test_models(served: Served) -> None:
    client = served.openai()
    ids = [m.id for m in client.models.list()]
    assert MODEL in ids
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model:1b")
    assert e.value.code == "model_not_found"


def test_embeddings_float_and_base64(served: Served) -> None:
    client = served.openai()
    res = client.embeddings.create(model=MODEL, input=["hello there", "goodbye"])  # the client asks for base64
    assert [d.index for d in res.data] == [0, 1]
    dims = len(res.data[0].embedding)
    assert dims == 576 and len(res.data[1].embedding) == dims  # SmolLM2-135M's embedding width
    assert abs(_norm(res.data[0].embedding) - 1) < 1e-3 and res.usage.prompt_tokens > 0
    floats = client.embeddings.create(model=MODEL, input="hello there", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(res.data[0].embedding, abs=1e-6)
    short = client.embeddings.create(model=MODEL, input="hello there", dimensions=64, encoding_format="float")
    assert len(short.data[0].embedding) == 64 and abs(_norm(short.data[0].embedding) - 1) < 1e-3


def test_embeddings_take_token_arrays(served: Served, starter: Path) -> None:
    from llama_cpp import Llama

    ids = Llama(str(starter), vocab_only=True, verbose=False).tokenize(b"hello there", add_bos=True, special=False)
    client = served.openai()
    text = client.embeddings.create(model=MODEL, input="hello there", encoding_format="float")
    one = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert one.data[0].embedding == pytest.approx(text.data[0].embedding, abs=1e-6)
    assert one.usage.prompt_tokens == len(ids) == text.usage.prompt_tokens
    many = client.embeddings.create(model=MODEL, input=[ids, ids[:1]], encoding_format="float")
    assert [d.index for d in many.data] == [0, 1]
    assert many.data[0].embedding == pytest.approx(text.data[0].embedding, abs=1e-6)
    assert many.data[1].embedding != pytest.approx(many.data[0].embedding, abs=1e-3)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=MODEL, input=[ids[0], 10**7])
    with pytest.raises(openai.BadRequestError, match="input"):
        client.embeddings.create(model=MODEL, input=["hello", 12])  # type: ignore[list-item]


def test_unknown_model_and_paths_are_not_found(served: Served, starter: Path) -> None:
    client = served.openai()
    # A name never becomes a path, even one of an existing model file.
    for name in ("smolm2:135m", str(starter), "../../etc/passwd", "/etc/passwd", "~/model.gguf"):
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model=name, messages=CHAT, max_tokens=2)
        assert e.value.code == "model_not_found", name
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError, match="did you mean 'smollm2:135m'"):
        client.completions.create(model="smolm2:135m", prompt="hi", max_tokens=2)


def test_prompt_longer_than_the_context(served: Served) -> None:
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 700}], max_tokens=2)
    assert e.value.code == "context_length_exceeded" and "context" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 700, max_tokens=2, stream=True)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="word " * 700)
    assert e.value.code == "context_length_exceeded"


def test_bad_json_and_bad_fields(served: Served) -> None:
    with served.http() as http:
        res = http.post("/v1/chat/completions", content=b'{"model": "smollm2:135m", "messages": [',
                        headers={"content-type": "application/json"})
        assert res.status_code == 400
        err = res.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and "not valid JSON" in err["message"]
        res = http.post("/v1/chat/completions", json=["not", "an", "object"])
        assert res.status_code == 400 and "JSON object" in res.json()["error"]["message"]
    client = served.openai()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature="hot")  # type: ignore[arg-type]
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert e.value.param == "messages"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="message 0: image 1 is not an image localrun can read"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    from tests.test_images import png

    image = "data:image/png;base64," + base64.b64encode(png(28, 28)).decode()
    with pytest.raises(openai.BadRequestError, match=f"'{MODEL}' does not support images"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "what is it?"}]}])
    with pytest.raises(openai.BadRequestError, match="does not fetch image URLs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="reads no files for image URLs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}])
    with pytest.raises(openai.BadRequestError, match="'input_audio' part; text and image_url parts"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])


def test_content_parts_and_developer_role(served: Served) -> None:
    client = served.openai()
    parts = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is the opposite"}, {"type": "text", "text": "of hot?"}]}])
    plain = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the opposite\nof hot?"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    penalized = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, presence_penalty=0.6,
                                               frequency_penalty=0.3, top_p=0.9, seed=3, stop=["\n"],
                                               extra_body={"top_k": 20, "min_p": 0.1})
    assert penalized.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, presence_penalty=3)
    assert e.value.param == "presence_penalty"
