"""The server's app factory, its middleware (access log, Host check, CORS, API key, body limit)
and the error tables' handlers; the routes are in openai.py and ollama.py, the bridge from the
engine to asyncio in streams.py."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localrun.errors import LocalrunError
from localrun.server import (
    errors,
    host_allowed,
    messages,
    ollama,
    openai,
    origin_regex,
    rerank,
    responses,
)
from localrun.server.response_store import ResponseStore
from localrun.server.streams import (  # noqa: F401 - ServerConfig and RequestRecord are this module's API too
    MAX_BODY,
    ClientGone,
    RequestRecord,
    ServerConfig,
    config_of,
)

if TYPE_CHECKING:
    from localrun.pool import Pool

# -- access rules (pure ASGI middleware: BaseHTTPMiddleware would break stream cancellation) --


async def _json(send: Send, status: int, body: dict[str, Any]) -> None:
    await JSONResponse(body, status_code=status)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


class AccessLog:
    """One line per request on stderr (method, path, model, status, tokens, tok/s), and the Host
    allowlist. Endpoints leave the model and token counts in the request's state."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        state = scope.setdefault("state", {})  # request.state of the endpoint, shared by reference

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope["path"]
        try:
            host = Headers(scope=scope).get("host")
            if not host_allowed(host, self.config.host):
                await _json(sending, 403, errors.http_body(path, 403, f"host '{host}' is not allowed"))
            else:
                await self.app(scope, receive, sending)
        except Exception:
            status = status or 500
            raise
        finally:
            note = state.get("log") or {}
            self.config.log(RequestRecord(
                scope["method"], path, status or 499, time.perf_counter() - t0, note.get("model"),
                note.get("tokens", 0), note.get("tokens_per_second", 0.0), note.get("finish_reason")))


def _zstd(data: bytes, limit: int) -> bytes:
    import io

    import zstandard

    try:
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read(limit + 1)
    except zstandard.ZstdError as e:
        raise ValueError(str(e)) from e


def _zlib(wbits: int) -> Callable[[bytes, int], bytes]:
    def decode(data: bytes, limit: int) -> bytes:
        import zlib

        try:
            return zlib.decompressobj(wbits).decompress(data, limit + 1)
        except zlib.error as e:
            raise ValueError(str(e)) from e

    return decode


# Content-Encoding -> decoder(body, most bytes wanted); more than that is a body too large.
_DECODERS: dict[str, Callable[[bytes, int], bytes]] = {
    "identity": lambda data, limit: data, "zstd": _zstd, "gzip": _zlib(31), "deflate": _zlib(15)}


class JsonBodies:
    """Request bodies: at most max_body bytes (413 in the API family's shape), read as JSON
    whatever their Content-Type (Ollama's examples use `curl -d`, which sends a form type), and
    decompressed when their Content-Encoding is zstd, gzip or deflate."""

    def __init__(self, app: ASGIApp, max_body: int) -> None:
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        text = f"the request body is larger than {self.max_body >> 20} MiB" if self.max_body >= 1 << 20 else \
            f"the request body is larger than {self.max_body} bytes"
        try:
            declared = int(Headers(scope=scope).get("content-length") or 0)
        except ValueError:
            declared = 0
        if declared > self.max_body:
            await _json(send, 413, errors.http_body(scope["path"], 413, text))
            return
        encoding = (Headers(scope=scope).get("content-encoding") or "identity").strip().lower()
        if encoding not in _DECODERS:
            await _json(send, 415, errors.http_body(scope["path"], 415, f"request bodies in {encoding!r} are not "
                                                                         "read; send zstd, gzip, deflate or none"))
            return
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-encoding")]
        scope["headers"] = [*headers, (b"content-type", b"application/json")]
        total = 0

        async def limited() -> Message:
            nonlocal total
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > self.max_body:  # a chunked body without Content-Length
                    raise StarletteHTTPException(413, text)
            return message

        if encoding == "identity":
            await self.app(scope, limited, send)
            return
        # A compressed body (Codex sends zstd) is read whole and decompressed, at most max_body bytes of it.
        parts, more = [], True
        while more:
            message = await limited()
            if message["type"] != "http.request":
                break
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        try:
            body = _DECODERS[encoding](b"".join(parts), self.max_body)
        except ValueError as e:
            await _json(send, 400, errors.http_body(scope["path"], 400, f"the {encoding} request body is corrupt ({e})"))
            return
        if len(body) > self.max_body:
            await _json(send, 413, errors.http_body(scope["path"], 413, text + " once decompressed"))
            return
        replayed = False

        async def whole() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, whole, send)


class ApiKey:
    """`Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on every route but /health and
    CORS preflights."""

    PUBLIC = ("/health",)

    def __init__(self, app: ASGIApp, key: str | None) -> None:
        self.app = app
        self.key = key.encode() if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and scope["path"] not in self.PUBLIC and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if headers.get("x-api-key") is not None:
                scheme, token, auth = "bearer", headers["x-api-key"], auth or "x-api-key"
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key):
                text = "invalid API key" if auth else "an API key is required: send 'Authorization: Bearer KEY'"
                await _json(send, 401, errors.http_body(scope["path"], 401, text))
                return
        await self.app(scope, receive, send)


# -- errors -------------------------------------------------------------------------------------


def error_response(request: HttpRequest, error: LocalrunError, param: str | None = None) -> JSONResponse:
    """A localrun error in the shape of the request's API family."""
    if errors.is_anthropic_path(request.url.path):
        return JSONResponse(errors.anthropic_body(error), status_code=errors.anthropic_status(error))
    if errors.is_openai_path(request.url.path):
        param = param or getattr(error, "param", None)
        return JSONResponse(errors.openai_body(error, param), status_code=errors.openai_status(error))
    return JSONResponse(errors.ollama_body(error), status_code=errors.ollama_status(error))


def _validation_text(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return "the request body must be a JSON object", None
    return (f"invalid value for '{param}': {first.get('msg', 'invalid')}" if param else str(first.get("msg"))), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(LocalrunError)
    async def _localrun(request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, LocalrunError)
        return error_response(request, exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: HttpRequest, exc: Exception) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        text, param = _validation_text(exc)
        if errors.is_anthropic_path(request.url.path):  # never a 500 for a malformed body
            return JSONResponse(errors.anthropic_http(400, text), status_code=400)
        if errors.is_openai_path(request.url.path):
            return JSONResponse(errors.openai_http(400, text, param), status_code=400)
        return JSONResponse({"error": text}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: HttpRequest, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        text = f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return JSONResponse(errors.http_body(request.url.path, exc.status_code, text), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: HttpRequest, exc: Exception) -> Response:
        text = f"internal server error: {type(exc).__name__}: {exc}"
        return JSONResponse(errors.http_body(request.url.path, 500, text), status_code=500)


# -- the app ----------------------------------------------------------------------------------


def create_app(pool: Pool, config: ServerConfig | None = None) -> FastAPI:
    """The ASGI app serving `pool` (from api.model_pool) with both API families."""
    from localrun import __version__

    config = config or ServerConfig()
    middleware = [
        Middleware(AccessLog, config=config),
        Middleware(CORSMiddleware, allow_origin_regex=origin_regex(config.origins), allow_methods=["*"],
                   allow_headers=["*"], expose_headers=["*"]),
        Middleware(ApiKey, key=config.api_key),
        Middleware(JsonBodies, max_body=config.max_body),
    ]
    app = FastAPI(title="localrun", version=__version__, middleware=middleware,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.pool = pool
    app.state.config = config
    app.state.responses = ResponseStore()
    app.state.mcp = config.mcp
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if pool.loading:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    app.include_router(ollama.router)
    app.include_router(rerank.router)
    return app
