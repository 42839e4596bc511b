"""The OpenAI API: /v1/chat/completions, /v1/completions, /v1/models, /v1/embeddings."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import struct
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from localrun import api
from localrun.adapters import Target
from localrun.chat import parse_messages
from localrun.errors import LocalrunError, UsageError
from localrun.generation import Chunk, Request
from localrun.server import display_name, errors, image_url, resolve_model, resolve_target
from localrun.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    EmbeddingRequest,
)
from localrun.server.streams import (
    Job,
    Run,
    RunResponse,
    check_images,
    config_of,
    embed,
    fit_vector,
    pool_of,
    resolve,
    run_blocking,
    start_run,
)
from localrun.store import ModelInfo
from localrun.tools import ToolPlan

router = APIRouter(prefix="/v1")
ROLES = {"developer": "system", "function": "tool"}  # OpenAI's newer and older names


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


_HOLE = "\u0000localrun-text\u0000"


def _sse_template(obj: Any) -> tuple[bytes, bytes]:
    """The bytes of _sse(obj) before and after the string _HOLE: the per-token event is then one
    json.dumps of the text, not of the whole chunk (the stream's hot path)."""
    data = _sse(obj)
    hole = json.dumps(_HOLE, ensure_ascii=False).encode()
    before, after = data.split(hole)
    return before, after


def _finish(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _message(message: ChatMessage, i: int, config: Any = None) -> dict[str, Any]:
    """A message as localrun's chat layer takes it (tool calls and results included; its image
    parts as the images' bytes, read as the server's config allows)."""
    out: dict[str, Any] = {"role": ROLES.get(message.role, message.role), "content": _text(message, i)}
    images = _images(message, i, config)
    if images:
        out["images"] = images
    if message.tool_calls:
        out["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None and out["role"] == "tool":
        out["name"] = message.name
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    return out


def _text(message: ChatMessage, i: int) -> str:
    """The message's text parts, joined (its images go before them, as llama-server places them)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type == "image_url":
            continue
        if part.type != "text" or part.text is None:
            raise UsageError(f"message {i} has a '{part.type}' part; text and image_url parts are supported",
                             "send text and image_url parts")
        parts.append(part.text)
    return "\n".join(parts)


def _images(message: ChatMessage, i: int, config: Any) -> list[bytes]:
    """The bytes of the message's image_url parts (read as `image_url` allows)."""
    if message.content is None or isinstance(message.content, str):
        return []
    out = []
    for j, part in enumerate(p for p in message.content if p.type == "image_url"):
        ref = (part.model_extra or {}).get("image_url")
        out.append(image_url(ref.get("url") if isinstance(ref, dict) else ref, f"message {i}: image {j + 1}", config))
    return out  # parse_messages checks each image


def _usage(run: Run, jobs: list[Job]) -> dict[str, Any]:
    """Token counts; a prompt answered by n choices counts once."""
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for i, chunk in run.finals.items():
        k = jobs[i].prompt_index
        prompts[k] = max(prompts.get(k, (0, 0)), (chunk.prompt_tokens, chunk.cached_tokens))
        completion += chunk.completion_tokens
    prompt = sum(p for p, _ in prompts.values())
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompts.values())}}
    drafted = sum(c.drafted_tokens for c in run.finals.values())
    if drafted:  # speculative decoding, in the fields OpenAI gives predicted outputs
        accepted = sum(c.accepted_tokens for c in run.finals.values())
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": drafted - accepted}
    return out


def _token(t: Any) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)}


def _chat_logprobs(tokens: list[Any]) -> dict[str, Any]:
    return {"content": [{**_token(t), "top_logprobs": [_token(a) for a in t.top]} for t in tokens], "refusal": None}


def _completion_logprobs(tokens: list[Any], offset: int) -> dict[str, Any]:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top} for t in tokens], "text_offset": offsets}


def _logprobs_of(chunk: Chunk) -> list[Any]:
    return list(chunk.logprobs)


async def _collect(run: Run, thoughts: dict[int, list[str]] | None = None) -> tuple[dict[int, str], dict[int, list[Any]]]:
    """Each choice's text and logprobs; a thinking model's thought goes to `thoughts`, if given."""
    texts: dict[int, list[str]] = defaultdict(list)
    lps: dict[int, list[Any]] = defaultdict(list)
    async for i, chunk in run.items():
        if not chunk.done:
            texts[i].append(chunk.text)
            lps[i].extend(_logprobs_of(chunk))
            if thoughts is not None and chunk.thinking:
                thoughts[i].append(chunk.thinking)
    return {i: "".join(t) for i, t in texts.items()}, lps


async def _model(name: str) -> ModelInfo:
    return await asyncio.to_thread(resolve_model, name)


async def _target(request: HttpRequest, name: str, lora: list[Any] | None) -> Target:
    config = config_of(request)
    return await asyncio.to_thread(resolve_target, name, lora, config.lora, config.aliases)


def _model_object(m: ModelInfo) -> dict[str, Any]:
    try:
        created = int(os.stat(m.path).st_mtime)
    except OSError:
        created = 0
    return {"id": display_name(m.name), "object": "model", "created": created, "owned_by": "localrun"}


# -- models ---------------------------------------------------------------------------------------


@router.get("/models")
async def list_models(request: HttpRequest) -> dict[str, Any]:
    """The installed models (in Anthropic's shape for a client that sends anthropic-version)."""
    models = await asyncio.to_thread(api.list_models)
    if "anthropic-version" in request.headers:
        from localrun.server.messages import models as anthropic_models

        return anthropic_models(models)
    return {"object": "list", "data": [_model_object(m) for m in models]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str) -> dict[str, Any]:
    """One installed model."""
    return _model_object(await _model(model_id))


# -- chat completions -----------------------------------------------------------------------------


@router.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: HttpRequest) -> Response:
    """A chat reply (n of them), streamed as Server-Sent Events or as one JSON object."""
    target = await _target(request, body.model, body.lora)
    model = target.model
    plan = ToolPlan.make(api.chat_template(model), body.tools, body.tool_choice, body.parallel_tool_calls)
    params = await resolve(request, target, body.settings(), body.constraint(), plan)
    config = config_of(request)
    messages = await asyncio.to_thread(
        lambda: parse_messages([_message(m, i, config) for i, m in enumerate(body.messages)]))
    req = plan.request(messages) if plan else Request(messages=tuple(messages))
    req = dataclasses.replace(req, think=body.think, template_kwargs=dict(body.chat_template_kwargs or {}))
    await check_images(request, req, model, body.model)
    jobs = [Job(req, params.choice(i)) for i in range(body.n)]
    run = start_run(request, target, jobs, None, stream=body.stream)
    await run.begin()
    name = display_name(target.name)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name,
            "system_fingerprint": "localrun"}
    if body.stream:
        base = {**head, "object": "chat.completion.chunk"}
        events = _sse_stream(_chat_events(run, jobs, base, body, plan), run, jobs, base, body.include_usage)
        return RunResponse(events, run, "text/event-stream")
    thoughts: dict[int, list[str]] = defaultdict(list)
    texts, lps = await run.complete(_collect(run, thoughts))
    choices = []
    for i in range(len(jobs)):
        message: dict[str, Any] = {"role": "assistant", "content": texts.get(i, "")}
        thought = "".join(thoughts.get(i, ()))
        finish = _finish(run.finals[i].finish_reason)
        if plan:
            content, calls = plan.parse(texts.get(i, ""))
            if calls:
                message = {"role": "assistant", "content": content or None, "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls"
        if thought:  # the field llama-server, vLLM and DeepSeek's API use
            message["reasoning_content"] = thought
        choices.append({"index": i, "message": message, "logprobs": _chat_logprobs(lps[i]) if body.logprobs else None,
                        "finish_reason": finish})
    return JSONResponse({**head, "object": "chat.completion", "choices": choices, "usage": _usage(run, jobs)})


def _call_delta(index: int, call_id: str | None, name: str | None, arguments: str | None) -> dict[str, Any]:
    """One streamed piece of a tool call, in OpenAI's delta shape."""
    fn: dict[str, Any] = {}
    if name is not None:
        fn["name"] = name
    if arguments is not None:
        fn["arguments"] = arguments
    out: dict[str, Any] = {"index": index, "function": fn}
    if call_id is not None:
        out.update(id=call_id, type="function")
    return out


async def _tool_events(run: Run, jobs: list[Job], plan: ToolPlan,
                       event: Callable[..., bytes]) -> AsyncIterator[bytes]:
    """A stream with tools: content deltas, and each call as index, id, name, then arguments in pieces."""
    streamers = [plan.streamer() for _ in jobs]
    called = [False] * len(jobs)

    def deltas(i: int, items: list[Any]) -> list[bytes]:
        out = []
        for item in items:
            if item[0] == "content":
                if item[1]:
                    out.append(event(i, {"content": item[1]}))
            else:
                called[i] = True
                out.append(event(i, {"tool_calls": [_call_delta(*item[1:])]}))
        return out

    async for i, chunk in run.items():
        streamer = streamers[i]
        if chunk.thinking:
            yield event(i, {"reasoning_content": chunk.thinking})
        if not chunk.done:
            items = streamer.feed(chunk.text) if streamer else [("content", chunk.text)]
        else:
            items = streamer.flush() if streamer else []
        for data in deltas(i, items):
            yield data
        if chunk.done:
            yield event(i, {}, "tool_calls" if called[i] else _finish(chunk.finish_reason))


async def _chat_events(run: Run, jobs: list[Job], base: dict[str, Any], body: ChatCompletionRequest,
                       plan: ToolPlan | None = None) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if body.include_usage else {}

    def event(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        return _sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
                     **extra})

    templates = [_sse_template({**base, "choices": [{"index": i, "delta": {"content": _HOLE}, "logprobs": None,
                                                      "finish_reason": None}], **extra}) for i in range(len(jobs))]
    dumps = json.dumps
    for i in range(len(jobs)):
        yield event(i, {"role": "assistant", "content": ""})
    if plan is not None:
        async for data in _tool_events(run, jobs, plan, event):
            yield data
        return
    async for i, chunk in run.items():
        if chunk.thinking:
            yield event(i, {"reasoning_content": chunk.thinking})
        if not chunk.done:
            if not body.logprobs:
                if chunk.text:
                    before, after = templates[i]
                    yield before + dumps(chunk.text, ensure_ascii=False).encode() + after
                continue
            lps = _logprobs_of(chunk)
            if chunk.text or lps:
                yield event(i, {"content": chunk.text}, logprobs=_chat_logprobs(lps))
        else:
            yield event(i, {}, _finish(chunk.finish_reason))


async def _sse_stream(events: AsyncIterator[bytes], run: Run, jobs: list[Job], base: dict[str, Any],
                      include_usage: bool) -> AsyncIterator[bytes]:
    """A stream's events, then the usage chunk if asked for and [DONE]; an error mid-stream ends
    it as an OpenAI error object."""
    try:
        async for event in events:
            yield event
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(run, jobs)})
        yield b"data: [DONE]\n\n"
    except LocalrunError as e:
        yield _sse(errors.openai_body(e))


# -- text completions -----------------------------------------------------------------------------


@router.post("/completions")
async def completions(body: CompletionRequest, request: HttpRequest) -> Response:
    """Plain-text continuations of each prompt (n per prompt), streamed or as one JSON object."""
    target = await _target(request, body.model, body.lora)
    # max_tokens 16 is OpenAI's default for text completions: under every other layer
    params = await resolve(request, target, body.settings(), body.constraint(), fallback={"max_tokens": 16})
    prompts = body.prompts()
    jobs = [Job(Request.raw(p), params.choice(j), k) for k, p in enumerate(prompts) for j in range(body.n)]
    run = start_run(request, target, jobs, None, stream=body.stream)
    await run.begin()
    name = display_name(target.name)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": name,
            "system_fingerprint": "localrun"}
    echo = [prompts[job.prompt_index] if body.echo else "" for job in jobs]
    if body.stream:
        base = {**head, "object": "text_completion"}
        events = _sse_stream(_completion_events(run, jobs, base, body, echo), run, jobs, base, body.include_usage)
        return RunResponse(events, run, "text/event-stream")
    thoughts: dict[int, list[str]] = defaultdict(list)  # a raw prompt that opened a thought
    texts, lps = await run.complete(_collect(run, thoughts))
    choices = [{"index": i, "text": echo[i] + texts.get(i, ""),
                **({"reasoning_content": "".join(thoughts[i])} if thoughts.get(i) else {}),
                "logprobs": _completion_logprobs(lps[i], 0) if body.logprobs is not None else None,
                "finish_reason": _finish(run.finals[i].finish_reason)} for i in range(len(jobs))]
    return JSONResponse({**head, "object": "text_completion", "choices": choices, "usage": _usage(run, jobs)})


async def _completion_events(run: Run, jobs: list[Job], base: dict[str, Any], body: CompletionRequest,
                             echo: list[str]) -> AsyncIterator[bytes]:
    extra: dict[str, Any] = {"usage": None} if body.include_usage else {}
    offsets = [0] * len(jobs)

    def event(i: int, text: str, finish: str | None = None, logprobs: Any = None, thinking: str = "") -> bytes:
        thought = {"reasoning_content": thinking} if thinking else {}
        return _sse({**base, "choices": [{"index": i, "text": text, **thought, "logprobs": logprobs,
                                          "finish_reason": finish}], **extra})

    for i, text in enumerate(echo):
        if text:
            yield event(i, text)
    async for i, chunk in run.items():
        if not chunk.done:
            lps = _logprobs_of(chunk)
            if chunk.text or lps or chunk.thinking:
                logprobs = _completion_logprobs(lps, offsets[i]) if body.logprobs is not None else None
                offsets[i] += len(chunk.text)
                yield event(i, chunk.text, logprobs=logprobs, thinking=chunk.thinking)
        else:
            yield event(i, "", _finish(chunk.finish_reason))


# -- embeddings -----------------------------------------------------------------------------------


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: HttpRequest) -> dict[str, Any]:
    """Embeddings of the inputs, unit length, as floats or base64 (little-endian float32)."""
    model = await _model(body.model)
    texts = body.texts()
    pool = pool_of(request)
    result, _ = await run_blocking(request, lambda: embed(pool, model, texts, None))
    name = display_name(model.name)
    request.state.log = {"model": name}
    data = []
    for i, vector in enumerate(result.vectors if result else []):
        v = fit_vector(vector, body.dimensions)
        value: Any = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if body.encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": value})
    tokens = int(result.prompt_tokens) if result else 0
    return {"object": "list", "data": data, "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
