"""Ollama's native API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/embed,
/api/pull, /api/delete, /api/version and GET / (field names as in ollama's api/types.go)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response

from localrun import api, settings, units
from localrun.adapters import Target
from localrun.chat import parse_messages
from localrun.errors import LocalrunError, UsageError
from localrun.generation import Chunk, Request
from localrun.server import display_name, errors, resolve_model, resolve_target
from localrun.server.schemas import (
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaCreateRequest,
    OllamaDeleteRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaGenerating,
    OllamaPullRequest,
    OllamaShowRequest,
)
from localrun.server.streams import (
    Emit,
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
from localrun.settings import GenerationParams
from localrun.store import ModelInfo
from localrun.tools import ToolPlan

router = APIRouter()
VERSION = "0.13.5"  # the Ollama API version this server speaks (Responses API: 0.13.3); clients check it
NDJSON = "application/x-ndjson"
FOREVER = timedelta(days=365 * 292)  # Ollama reports "never expires" as now + the largest Go duration


def _now() -> str:
    return _iso(datetime.now(timezone.utc))


def _iso(dt: datetime) -> str:
    return dt.astimezone(timezone.utc).isoformat().replace("+00:00", "Z")


def _line(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _done_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"


def _stats(run: Run, chunk: Chunk) -> dict[str, Any]:
    return {"done_reason": _done_reason(chunk.finish_reason), "total_duration": _ns(time.perf_counter() - run.started),
            "load_duration": _ns(run.load_seconds), "prompt_eval_count": chunk.prompt_tokens,
            "prompt_eval_duration": int(chunk.prompt_ms * 1e6), "eval_count": chunk.completion_tokens,
            "eval_duration": int(chunk.decode_ms * 1e6),
            **({"drafted_tokens": chunk.drafted_tokens, "accepted_tokens": chunk.accepted_tokens}
               if chunk.drafted_tokens else {})}


def _logprobs(chunk: Chunk) -> list[dict[str, Any]]:
    return [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": list(a.bytes)} for a in t.top]}
            for t in chunk.logprobs]


async def _model(name: str) -> ModelInfo:
    return await asyncio.to_thread(resolve_model, name)


async def _target(request: HttpRequest, name: str, lora: list[Any] | None) -> Target:
    config = config_of(request)
    return await asyncio.to_thread(resolve_target, name, lora, config.lora, config.aliases)


def _digest(m: ModelInfo) -> str:
    """A stable identifier of the installed file (hashing gigabytes per listing would be too slow)."""
    try:
        mtime = os.stat(m.path).st_mtime_ns
    except OSError:
        mtime = 0
    return hashlib.sha256(f"{m.path}\0{m.size}\0{mtime}".encode()).hexdigest()


def _modified(m: ModelInfo) -> str:
    try:
        return _iso(datetime.fromtimestamp(os.stat(m.path).st_mtime, timezone.utc))
    except OSError:
        return _now()


def _details(m: ModelInfo) -> dict[str, Any]:
    family = m.architecture or ""
    return {"parent_model": "", "format": m.format, "family": family, "families": [family] if family else None,
            "parameter_size": units.count(m.parameters) if m.parameters else "",
            "quantization_level": m.quantization or ""}


# -- generation -----------------------------------------------------------------------------------


async def _load_or_unload(request: HttpRequest, body: OllamaGenerating, model: ModelInfo, reply: dict[str, Any]) -> Response:
    """An empty prompt: keep_alive 0 unloads the model now, anything else loads it."""
    keep_alive = body.keep_alive_seconds()
    pool = pool_of(request)
    request.state.log = {"model": display_name(model.name)}
    if keep_alive == 0:
        await asyncio.to_thread(pool.unload, model.name)
        return JSONResponse({"model": body.model, "created_at": _now(), **reply, "done": True, "done_reason": "unload"})

    def load() -> None:
        with pool.use(model, keep_alive, body.options.load_options(pool.options)):
            pass

    await run_blocking(request, load)
    return JSONResponse({"model": body.model, "created_at": _now(), **reply, "done": True, "done_reason": "load"})


def _reply(key: str, text: str, thinking: str = "") -> dict[str, Any]:
    """A line's reply fields: the message (with its thinking) in chat, response and thinking in generate."""
    if key == "message":
        msg = {"role": "assistant", "content": text}
        return {"message": {**msg, "thinking": thinking} if thinking else msg}
    return {"response": text, "thinking": thinking} if thinking else {"response": text}


async def _answer(request: HttpRequest, body: OllamaGenerating, target: Target, req: Request, params: GenerationParams,
                  key: str, plan: ToolPlan | None = None) -> Response:
    """Stream (NDJSON) or return the reply; `key` is "message" (chat) or "response" (generate)."""
    run = start_run(request, target, [Job(req, params)], body.keep_alive_seconds(),
                    body.options.load_options(pool_of(request).options), stream=bool(body.stream))
    await run.begin()

    if body.stream:
        lines = _tool_lines(run, body, plan) if plan is not None else _lines(run, body, key)
        return RunResponse(lines, run, NDJSON)
    parts: list[str] = []
    thought: list[str] = []
    lps: list[dict[str, Any]] = []

    async def collect() -> None:
        async for _, chunk in run.items():
            if not chunk.done:
                parts.append(chunk.text)
                thought.append(chunk.thinking)
                lps.extend(_logprobs(chunk))

    await run.complete(collect())
    out = {"model": body.model, "created_at": _now(), **_reply(key, "".join(parts), "".join(thought)), "done": True,
           **_stats(run, run.finals[0])}
    if plan is not None:
        content, calls = plan.parse("".join(parts))
        out[key] = {**out[key], "content": content}
        if calls:
            out[key]["tool_calls"] = [c.to_ollama() for c in calls]
    if body.logprobs:
        out["logprobs"] = lps
    return JSONResponse(out)


async def _lines(run: Run, body: OllamaGenerating, key: str) -> AsyncIterator[bytes]:
    try:
        async for _, chunk in run.items():
            if chunk.done:
                yield _line({"model": body.model, "created_at": _now(), **_reply(key, ""), "done": True,
                             **_stats(run, chunk)})
            elif chunk.text or chunk.thinking or body.logprobs:
                line: dict[str, Any] = {"model": body.model, "created_at": _now(), **_reply(key, chunk.text, chunk.thinking),
                                        "done": False}
                if body.logprobs:
                    line["logprobs"] = _logprobs(chunk)
                yield _line(line)
    except LocalrunError as e:
        yield _line(errors.ollama_body(e))


async def _tool_lines(run: Run, body: OllamaGenerating, plan: ToolPlan) -> AsyncIterator[bytes]:
    """A chat stream with tools: content as it comes; the calls, whole (arguments as objects),
    in one message before the last line, as Ollama sends them."""
    streamer = plan.streamer()
    calls: dict[int, dict[str, Any]] = {}

    def message(content: str, thinking: str = "") -> bytes:
        return _line({"model": body.model, "created_at": _now(), **_reply("message", content, thinking), "done": False})

    def take(items: list[Any]) -> str:
        text = ""
        for item in items:
            if item[0] == "content":
                text += item[1]
                continue
            _, index, _, name, arguments = item
            call = calls.setdefault(index, {"name": "", "arguments": ""})
            call["name"] += name or ""
            call["arguments"] += arguments or ""
        return text

    try:
        async for _, chunk in run.items():
            if not chunk.done:
                text = take(streamer.feed(chunk.text)) if streamer and chunk.text else chunk.text
                if text or chunk.thinking:
                    yield message(text, chunk.thinking)
                continue
            text = take(streamer.flush()) if streamer else ""
            if text:
                yield message(text)
            if calls:
                tool_calls = [{"function": {"name": c["name"], "arguments": json.loads(c["arguments"] or "{}")}}
                              for _, c in sorted(calls.items())]
                yield _line({"model": body.model, "created_at": _now(),
                             "message": {"role": "assistant", "content": "", "tool_calls": tool_calls}, "done": False})
            yield _line({"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                         "done": True, **_stats(run, chunk)})
    except LocalrunError as e:
        yield _line(errors.ollama_body(e))


def _message(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
    if m.tool_name:
        out["name"] = m.tool_name
    if m.thinking:
        out["thinking"] = m.thinking
    if m.images:
        out["images"] = m.images  # base64, decoded and checked by parse_messages
    return out


async def _think(body: OllamaGenerating, model: ModelInfo) -> bool | str | None:
    """The request's think; asking a model that cannot think to think is refused, as Ollama does."""
    if body.think not in (None, False):
        caps = await asyncio.to_thread(api.capabilities, model)
        if "thinking" not in caps:
            raise UsageError(f'"{body.model}" does not support thinking',
                             "send the request without think, or use a model that thinks")
    return body.think


@router.post("/api/chat")
async def chat(body: OllamaChatRequest, request: HttpRequest) -> Response:
    """The next assistant message; an empty message list loads (or, keep_alive 0, unloads) the model."""
    target = await _target(request, body.required_model(), body.lora)
    model = target.model
    plan = ToolPlan.make(api.chat_template(model), body.tools, None)
    params = await resolve(request, target, body.settings(), body.constraint(), plan)
    think = await _think(body, model)
    if not body.messages:
        return await _load_or_unload(request, body, model, {"message": {"role": "assistant", "content": ""}})
    messages = parse_messages([_message(m) for m in body.messages])
    req = plan.request(messages) if plan else Request(messages=tuple(messages))
    req = dataclasses.replace(req, think=think)
    await check_images(request, req, model, body.model)
    return await _answer(request, body, target, req, params, "message", plan)


@router.post("/api/generate")
async def generate_(body: OllamaGenerateRequest, request: HttpRequest) -> Response:
    """A completion of the prompt (templated as a user turn unless raw); an empty prompt loads
    or unloads the model."""
    target = await _target(request, body.required_model(), body.lora)
    model = target.model
    params = await resolve(request, target, body.settings(), body.constraint())
    think = await _think(body, model)
    if not body.prompt:
        return await _load_or_unload(request, body, model, {"response": ""})
    if body.raw:
        if body.images:
            raise UsageError("images need the chat template", "send the request without raw")
        req = Request.raw(body.prompt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt, **({"images": body.images} if body.images else {})}]
        req = Request.chat(messages, think=think)
        if body.template:  # this request's own template (Go, as Ollama's; or Jinja)
            from localrun.presets import translate_template

            req = dataclasses.replace(req, template=translate_template(body.template, None)[0])
    await check_images(request, req, model, body.model)
    return await _answer(request, body, target, req, params, "response")


# -- embeddings -----------------------------------------------------------------------------------


@router.post("/api/embed")
async def embed_(body: OllamaEmbedRequest, request: HttpRequest) -> dict[str, Any]:
    """Unit-length embeddings of each input; an input longer than the context is an error (never truncated)."""
    t0 = time.perf_counter()
    model = await _model(body.required_model())
    keep_alive = body.keep_alive_seconds()
    texts = body.texts()
    pool = pool_of(request)
    options = body.options.load_options(pool.options)
    result, loaded = await run_blocking(request, lambda: embed(pool, model, texts, keep_alive, options))
    request.state.log = {"model": display_name(model.name)}
    vectors = [fit_vector(v, body.dimensions) for v in (result.vectors if result else [])]
    return {"model": body.model, "embeddings": vectors, "total_duration": _ns(time.perf_counter() - t0),
            "load_duration": _ns(loaded), "prompt_eval_count": int(result.prompt_tokens) if result else 0}


@router.post("/api/embeddings")
async def embeddings(body: OllamaEmbeddingsRequest, request: HttpRequest) -> dict[str, Any]:
    """The older single-prompt endpoint: {"embedding": [...]}."""
    model = await _model(body.required_model())
    keep_alive = body.keep_alive_seconds()
    texts = [body.prompt] if body.prompt else []
    pool = pool_of(request)
    options = body.options.load_options(pool.options)
    result, _ = await run_blocking(request, lambda: embed(pool, model, texts, keep_alive, options))
    request.state.log = {"model": display_name(model.name)}
    return {"embedding": list(result.vectors[0]) if result else []}


# -- models ---------------------------------------------------------------------------------------


@router.api_route("/api/tags", methods=["GET", "HEAD"])
async def tags() -> dict[str, Any]:
    """The installed models."""
    models = await asyncio.to_thread(api.list_models)
    return {"models": [{"name": display_name(m.name), "model": display_name(m.name), "modified_at": _modified(m),
                        "size": m.size, "digest": _digest(m), "details": _details(m)} for m in models]}


@router.post("/api/show")
async def show(body: OllamaShowRequest, request: HttpRequest) -> dict[str, Any]:
    """A model's details, GGUF metadata (model_info), parameters, template, system prompt, Modelfile
    and capabilities (a preset's own settings over its base's)."""
    target = await _target(request, body.required_model(), None)
    model = target.model
    meta = model.details.get("metadata") or {}
    info = {k: (None if isinstance(v, str) and v.startswith("[") and v.endswith(" items]") else v)
            for k, v in meta.items()}
    if model.parameters:
        info.setdefault("general.parameter_count", model.parameters)
    d = settings.resolve(target=target, defaults=config_of(request).settings)
    pool = pool_of(request)
    preset = target.preset
    engine = await asyncio.to_thread(api.choose_engine, model, pool.engine) if preset else None
    options = target.load_options(pool.options, engine) if engine else pool.options
    capabilities, context, modelfile = await asyncio.to_thread(
        lambda: (api.capabilities(model, pool.engine), api.default_context(model, options),
                 api.modelfile(target.preset_name or model.name)))
    rows: list[tuple[str, Any]] = [("temperature", d.temperature), ("top_k", d.top_k), ("top_p", d.top_p),
                                   ("min_p", d.min_p), ("num_ctx", context.tokens)]
    own = dict(preset.parameters) if preset else {}
    rows += [(k, v) for k, v in own.items() if k not in {r[0] for r in rows} and k != "stop"]
    rows += [("stop", json.dumps(s)) for s in own.get("stop", [])]
    parameters = "\n".join(f"{k:<30} {v}" for k, v in rows)
    template = (preset.template_source or preset.template if preset and preset.template else None) \
        or model.details.get("chat_template") or ""
    out: dict[str, Any] = {
        "modelfile": modelfile, "parameters": parameters, "template": template, "details": _details(model),
        "model_info": info, "capabilities": list(capabilities), "modified_at": _modified(model),
    }
    if preset and preset.system:
        out["system"] = preset.system
    if preset and preset.messages:
        out["messages"] = [dict(m) for m in preset.messages]
    if preset and preset.license:
        out["license"] = "\n".join(preset.license)
    elif model.details.get("license"):
        out["license"] = str(model.details["license"])
    if preset:
        out["details"]["parent_model"] = display_name(model.name)
    return out


@router.post("/api/create")
async def create(body: OllamaCreateRequest, request: HttpRequest) -> Response:
    """A preset from a Modelfile's text or from `from` + system, template, parameters, messages,
    license: a store entry on its base (nothing copied), streamed as Ollama's status lines."""
    from localrun.presets import preset_from_fields, read_modelfile

    name = body.required_model()
    if body.files or body.quantize:
        raise UsageError("creating from uploaded files or quantizing on create is not supported",
                         "create FROM an installed model (localrun pull or add it first), or quantize with 'localrun convert'")

    def make() -> ModelInfo:
        if body.modelfile:
            preset = read_modelfile(body.modelfile, os.path.abspath)
        else:
            if not body.from_:
                raise UsageError("from is required", "send the base model, e.g. \"from\": \"smollm2:135m\"")
            preset = preset_from_fields(body.from_, body.system, body.parameters, body.template,
                                        body.messages or (), body.license, list(body.adapters or {}))
        return api.create_preset(name, preset=preset)

    model = await asyncio.to_thread(make)
    request.state.log = {"model": display_name(model.name)}
    lines = [{"status": "using existing layer " + display_name(model.base or "")}, {"status": "writing manifest"},
             {"status": "success"}]
    if body.stream:
        return Response(b"".join(_line(x) for x in lines), media_type=NDJSON)
    return JSONResponse(lines[-1])


@router.post("/api/copy")
async def copy(body: OllamaCopyRequest) -> Response:
    """Another name for a model (the same file) or a preset (the same settings)."""
    await asyncio.to_thread(api.copy_model, body.source, body.destination)
    return Response(status_code=200)


@router.get("/api/ps")
async def ps(request: HttpRequest) -> dict[str, Any]:
    """The loaded models and when they expire, the longest-lived first."""
    loaded = pool_of(request).loaded()
    now = datetime.now(timezone.utc)
    models: list[dict[str, Any]] = []
    for lm in loaded:
        expires = now + FOREVER if lm.expires_at is None else datetime.fromtimestamp(lm.expires_at, timezone.utc)
        models.append({"name": display_name(lm.name), "model": display_name(lm.name), "size": lm.size,
                       "digest": _digest(lm.model), "details": _details(lm.model), "expires_at": _iso(expires),
                       "size_vram": lm.size if (lm.info or {}).get("offloaded") else 0,
                       "context_length": (lm.info or {}).get("n_ctx") or 0,
                       "kv_cache_type": (lm.info or {}).get("kv_type") or "f16"})  # localrun's extension
    models.sort(key=lambda m: m["expires_at"], reverse=True)
    return {"models": models}


@router.delete("/api/delete")
async def delete(body: OllamaDeleteRequest, request: HttpRequest) -> Response:
    """Unload and remove a model (files the store downloaded are deleted, added files are kept)."""
    model = await _model(body.required_model())
    request.state.log = {"model": display_name(model.name)}
    await asyncio.to_thread(pool_of(request).unload, model.name)
    await asyncio.to_thread(api.remove_model, model.name)
    return Response(status_code=200)


def _hub_spec(name: str) -> str:
    """A Hub spec from an Ollama-style pull name: `hf.co/ORG/NAME:QUANT` or `ORG/NAME[:QUANT]`;
    the default tag `latest` means the default quantization."""
    spec = name.strip()
    if spec.endswith(":latest"):
        spec = spec[: -len(":latest")]
    if "/" not in spec:
        raise UsageError(f"'{name}' is an Ollama library name; this server pulls from Hugging Face",
                         "pull ORG/NAME[:QUANT] or hf.co/ORG/NAME[:QUANT], e.g. 'hf.co/Qwen/Qwen3-0.6B-GGUF:Q4_K_M'")
    return spec


@router.post("/api/pull")
async def pull(body: OllamaPullRequest, request: HttpRequest) -> Response:
    """Download a model from the Hub through localrun's own pull, streaming status lines."""
    if not config_of(request).pull_allowed:
        return JSONResponse({"error": "pulling models is off on a server that listens beyond loopback; "
                                      "restart it with --allow-pull"}, status_code=403)
    spec = _hub_spec(body.required_model())

    def work(run: Run, emit: Emit) -> None:
        # The first line waits for the plan, so an unknown repository still gets its status code.
        begun = False

        def progress(p: Any) -> None:
            nonlocal begun
            if not begun:
                begun = True
                emit({"status": "pulling manifest"})
            if p.phase == "verify":
                emit({"status": "verifying sha256 digest", "digest": p.filename})
            else:
                emit({"status": f"pulling {p.filename}", "digest": p.filename, "total": p.total, "completed": p.done})

        api.pull(spec, progress=progress, cancel=run.cancel)
        if not begun:
            emit({"status": "pulling manifest"})
        emit({"status": "writing manifest"})
        emit({"status": "success"})

    run = Run([work], request, spec)
    await run.begin()
    if body.stream:
        return RunResponse(_pull_lines(run), run, NDJSON)
    last: dict[str, Any] = {}

    async def collect() -> None:
        nonlocal last
        async for _, item in run.items():
            last = item

    await run.complete(collect())
    return JSONResponse(last)


async def _pull_lines(run: Run) -> AsyncIterator[bytes]:
    try:
        async for _, item in run.items():
            yield _line(item)
    except LocalrunError as e:
        yield _line(errors.ollama_body(e))


# -- the server itself ------------------------------------------------------------------------------


@router.api_route("/api/version", methods=["GET", "HEAD"])
async def version() -> dict[str, str]:
    from localrun import __version__

    return {"version": VERSION, "localrun": __version__}


@router.api_route("/", methods=["GET", "HEAD"])
async def root() -> Response:
    return PlainTextResponse("localrun is running (Ollama and OpenAI APIs)")
