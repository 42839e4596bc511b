"""The HTTP front end: an OpenAI- and Ollama-compatible server over the model pool.

FastAPI is imported by the submodules only (app, openai, ollama, schemas); the server's rules
that need no web framework live here: durations, model names, which hosts and origins may call.
"""

from __future__ import annotations

import difflib
import functools
import ipaddress
import math
import re
import socket
from typing import TYPE_CHECKING, Any

from localrun import api
from localrun.errors import ModelNotFoundError, UsageError
from localrun.store import ModelInfo, normalize_name

if TYPE_CHECKING:
    from localrun.adapters import Target

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: float | int | str, what: str = "keep_alive") -> float:
    """Seconds from Ollama's keep_alive forms: a number of seconds or a Go duration ("5m", "1h30m");
    negative means forever (math.inf)."""
    if isinstance(value, bool):
        raise UsageError(f"invalid {what}: {value!r}", "use seconds, a duration such as '5m', or -1 for forever")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _PART.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise UsageError(f"invalid {what}: {value!r}",
                                 "use seconds, a duration such as '5m' or '1h30m', or -1 for forever") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise UsageError(f"invalid {what}: {value!r}", "use seconds, a duration such as '5m', or -1 for forever")
    return math.inf if seconds < 0 else seconds


# -- model names ------------------------------------------------------------------------------


def display_name(name: str) -> str:
    """Ollama's form of a store name: always with a tag."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"


def resolve_model(name: str) -> ModelInfo:
    """The installed model of that name; names only resolve through the store, never as paths."""
    wanted = normalize_name(name)
    if not wanted:
        raise ModelNotFoundError("no model was named", "send the model name, e.g. \"model\": \"smollm2:135m\"")
    names = api.store().names()
    candidates = [wanted, f"{wanted}:latest"]
    if wanted.endswith(":latest"):
        candidates.append(wanted[: -len(":latest")])
    family = [n for n in names if n.split(":", 1)[0] == wanted]
    if len(family) == 1 and ":" not in wanted:
        candidates.append(family[0])
    for candidate in candidates:
        if candidate in names:
            return api.get_model(candidate)
    close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.5)
    listed = ", ".join(display_name(n) for n in sorted(names)[:20]) or "none"
    hint = f"did you mean {', '.join(repr(display_name(c)) for c in close)}?" if close else \
        f"installed: {listed}; or map the name to one with 'serve --alias PATTERN=MODEL'"
    raise ModelNotFoundError(f"model '{name}' is not installed", hint)


def aliased(name: str, aliases: tuple[tuple[str, str], ...] = ()) -> str:
    """The model a requested name stands for under `serve --alias PATTERN=MODEL` (the first pattern
    that matches, * and ? as in file names: claude-haiku-*=qwen3:4b), else the name itself."""
    import fnmatch

    for pattern, model in aliases:
        if fnmatch.fnmatchcase(name, pattern):
            return model
    return name


def resolve_target(name: str, lora: list[Any] | None = None,
                   defaults: tuple[tuple[str, float], ...] = (), aliases: tuple[tuple[str, str], ...] = ()) -> Target:
    """The base model and adapters of a request: `model` may name an adapter (its base runs with
    it) or `base+adapter[:scale]+...` (Ollama-style), and `lora` (an extension) adds adapters as
    [{"name", "scale"}]. Like models, adapters resolve only through the store, never as paths.
    A request that names no adapters (no `+`, no `lora`, not an adapter) for the base of one of
    `defaults` (serve --lora) runs with those."""
    from localrun import adapters

    parts = aliased(name, aliases).split("+")
    base = resolve_model(parts[0])
    refs: list[tuple[ModelInfo, float]] = []
    for spec in parts[1:]:
        adapter_name, scale = adapters.parse_spec(spec)
        refs.append((resolve_model(adapter_name), scale))
    refs += [(resolve_model(ref.name), float(ref.scale)) for ref in lora or ()]
    if not refs and lora is None and not base.is_adapter:
        for adapter_name, scale in defaults:
            adapter = resolve_model(adapter_name)
            if adapter.base == base.name:
                refs.append((adapter, scale))
    return adapters.make_target(api.store(), base, refs)


# -- what a request may name -------------------------------------------------------------------


def image_url(url: Any, what: str, config: Any) -> bytes:
    """An image a request names by URL: a data URI; a file:// URL inside `serve --media-dir`; an
    http(s) URL with `serve --allow-fetch`. Anything else is refused, naming the image."""
    import os
    from urllib.parse import unquote, urlparse

    from localrun import images

    if not isinstance(url, str) or not url:
        raise UsageError(f"{what} has no url", 'send {"type": "image_url", "image_url": {"url": "data:..."}}')
    if url.startswith("data:"):
        return images.from_base64(url, what)
    if url.startswith("file://"):
        media_dir = getattr(config, "media_dir", None)
        if not media_dir:
            raise UsageError(f"{what}: this server reads no files for image URLs",
                             "send the image as a data URI, or start the server with --media-dir DIR")
        path = os.path.realpath(unquote(urlparse(url).path))
        if os.path.commonpath([path, media_dir]) != media_dir:
            raise UsageError(f"{what}: {path} is outside the server's --media-dir ({media_dir})")
        return images.read_file(path, what)
    if url.startswith(("http://", "https://")):
        if not getattr(config, "allow_fetch", False):
            raise UsageError(f"{what}: this server does not fetch image URLs ({url[:80]})",
                             "send the image as a data URI, or start the server with --allow-fetch")
        return images.fetch(url, what)
    raise UsageError(f"{what}: the url must be a data URI (or file:// / http(s) where the server allows)")


# -- who may call -------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether an address (or `localhost`) is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The host part of a Host header: `[::1]:8080` -> `::1`, `localhost:11434` -> `localhost`."""
    if value.startswith("["):
        return value[1:].partition("]")[0]
    host, sep, port = value.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else value


@functools.lru_cache(maxsize=1)
def _own_addresses() -> set[str]:
    names = {socket.gethostname()}
    try:
        names.add(socket.getfqdn())
        out = {str(info[4][0]) for name in names for info in socket.getaddrinfo(name, None)}
    except OSError:
        out = set()
    return out


def host_allowed(header: str | None, bound: str) -> bool:
    """Ollama's rule against DNS rebinding: on a loopback address, only local names reach the
    server (loopback and private IPs, the machine's own addresses, localhost, the host name,
    *.localhost, *.local, *.internal); an address beyond loopback was chosen on purpose."""
    if not is_loopback(bound):
        return True
    host = _split_host((header or "").strip()).lower().rstrip(".")
    if not host:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host in ("localhost", socket.gethostname().lower()) or host.endswith((".localhost", ".local", ".internal"))
    return ip.is_loopback or ip.is_private or ip.is_unspecified or host in _own_addresses()


def origin_regex(extra: tuple[str, ...]) -> str:
    """Browser origins allowed by CORS: localhost on any port, local app schemes, and --origins
    (where `*` is a wildcard)."""
    parts = [r"https?://(localhost|127\.0\.0\.1|0\.0\.0\.0|\[::1\])(:\d+)?",
             r"(app|file|tauri|vscode-webview|vscode-file)://.*"]
    parts += [".*".join(re.escape(p) for p in o.strip().rstrip("/").split("*")) for o in extra if o.strip()]
    return "^(" + "|".join(parts) + ")$"
