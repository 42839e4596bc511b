"""Sixteen concurrent streaming clients on one model (continuous batching) get, greedy, the same
text token for token as the same requests run one after another on a separately loaded session."""

from __future__ import annotations

import asyncio

from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from tests.test_batch import run_reference

from .conftest import MODEL, serve

OPTIONS = LoadOptions(n_ctx=256, n_parallel=16, max_queue=16)
TOKENS = 16
QUESTIONS = [f"In one sentence, what is {thing}?" for thing in (
    "a cat", "the sun", "rain", "a violin", "bread", "a river", "winter", "a bicycle",
    "a library", "the moon", "coffee", "a forest", "an island", "a clock", "snow", "a bridge")]


def _sequential() -> list[tuple[str, int]]:
    requests = [Request.chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    return run_reference(requests, GenerationParams(temperature=0, max_tokens=TOKENS), OPTIONS)


def test_sixteen_concurrent_streams_equal_sequential_greedy() -> None:
    import ollama

    expected = _sequential()
    with serve(OPTIONS) as s:
        async def openai_client(q: str) -> tuple[str, int]:
            async with s.async_openai() as client:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=TOKENS,
                    stream=True, stream_options={"include_usage": True})
                parts, used = [], 0
                async for c in stream:
                    if c.choices:
                        parts.append(c.choices[0].delta.content or "")
                    if c.usage:
                        used = c.usage.completion_tokens
                return "".join(parts), used

        async def ollama_client(q: str) -> tuple[str, int]:
            client = ollama.AsyncClient(host=s.url, timeout=300)
            parts, used = [], 0
            async for part in await client.chat(model=MODEL, messages=[{"role": "user", "content": q}], stream=True,
                                                options={"temperature": 0, "num_predict": TOKENS}):
                parts.append(part.message.content)
                if part.done:
                    used = part.eval_count
            return "".join(parts), used

        async def main() -> list[tuple[str, int]]:
            # Both API families at once: even questions through OpenAI's client, odd through Ollama's.
            return await asyncio.gather(*(openai_client(q) if i % 2 == 0 else ollama_client(q)
                                          for i, q in enumerate(QUESTIONS)))

        got = asyncio.run(main())
    for q, want, have in zip(QUESTIONS, expected, got, strict=True):
        assert have == want, q
