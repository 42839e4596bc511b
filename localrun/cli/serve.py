"""`localrun serve` (an OpenAI- and Ollama-compatible HTTP server) and `localrun ps`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from localrun.cli.options import (
    MAX_PARALLEL,
    add_generation_flags,
    add_load_flags,
    add_setting_flags,
    int_in,
    load_options_from_args,
)

if TYPE_CHECKING:
    from localrun.backends.base import Session
    from localrun.store import ModelInfo

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11434  # Ollama's, so its clients work with no configuration


def _max_loaded(value: str) -> int:
    return 0 if value == "auto" else int_in(1)(value)


def _duration(value: str) -> float:
    from localrun.errors import UsageError
    from localrun.server import parse_duration

    try:
        return parse_duration(value, "--keep-alive")
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve models over HTTP (OpenAI and Ollama APIs)", description=cmd_serve.__doc__)
    g = p.add_argument_group("address and access")
    g.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to listen on (default {DEFAULT_HOST}; 0.0.0.0 makes the models reachable from other machines)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}, Ollama's)")
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $LOCALRUN_API_KEY; none: open)")
    g.add_argument("--origins", action="append", default=[], metavar="ORIGIN",
                   help="browser origins allowed besides localhost, e.g. 'https://app.example' or 'https://*.example' (repeatable)")
    g.add_argument("--media-dir", metavar="DIR",
                   help="let OpenAI image_url parts name files (file://) inside this folder (default: none)")
    g.add_argument("--allow-fetch", action="store_true",
                   help="fetch OpenAI image_url parts given as http(s) URLs (default: refused; send data URIs)")
    g.add_argument("--allow-pull", action="store_true",
                   help="allow /api/pull when listening beyond loopback (always allowed on 127.0.0.1)")
    m = p.add_argument_group("models")
    m.add_argument("--parallel", type=int_in(1, MAX_PARALLEL), default=4, metavar="N",
                   help="sequences each model decodes at once (default 4; each has the full --ctx)")
    m.add_argument("--max-queue", type=int_in(0), default=64, metavar="N",
                   help="requests that may wait per model beyond --parallel; more get 503 (default 64)")
    m.add_argument("--cache-ram", type=int_in(0), default=None, metavar="MiB",
                   help="host memory that keeps prompt prefixes evicted from each model's KV cache, restored when "
                        "a prompt starts with one again: a conversation another one displaced, a branch "
                        "(llama.cpp engine; default 4096, at most an eighth of the memory; 0: off)")
    m.add_argument("--max-loaded", type=_max_loaded, default=0, metavar="N|auto",
                   help="models loaded at once (default auto: as many as the memory holds with their KV caches; "
                        "a model that does not fit beside the others waits for them to go idle, then replaces "
                        "the ones idle longest)")
    m.add_argument("--mcp", metavar="FILE",
                   help="an mcp.json naming the MCP servers that the Responses API's mcp tools may use (by "
                        "server_label); requests can use no other")
    m.add_argument("--alias", action="append", default=[], metavar="PATTERN=MODEL",
                   help="serve MODEL for requested names that match PATTERN (* and ? wildcards): the model tiers "
                        "an agent asks for, e.g. --alias 'claude-haiku-*=qwen3:4b' --alias 'claude-*=qwen3:30b' "
                        "(the first match wins; repeatable)")
    m.add_argument("--keep-alive", type=_duration, default=300.0, metavar="DURATION",
                   help="how long a model stays loaded after its last request: seconds, '5m', '1h', -1 for forever (default 5m)")
    # Generation flags are the server's defaults: under each request's own settings, its preset's and its
    # model's. --draft MODEL drafts for the models whose vocabulary it shares.
    add_generation_flags(p, system=False)
    add_setting_flags(p.add_argument_group("thinking models"), "thinking")
    add_load_flags(p)
    p.set_defaults(func=cmd_serve)

    ps = sub.add_parser("ps", help="list the models a running server has loaded", description=cmd_ps.__doc__)
    ps.add_argument("--host", default=DEFAULT_HOST, help=f"the server's address (default {DEFAULT_HOST})")
    ps.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"the server's port (default {DEFAULT_PORT})")
    ps.add_argument("--api-key", help="the server's API key (default: $LOCALRUN_API_KEY)")
    ps.add_argument("--json", action="store_true", help="print the server's JSON answer")
    ps.set_defaults(func=cmd_ps)


def _aliases(values: list[str]) -> tuple[tuple[str, str], ...]:
    """--alias PATTERN=MODEL pairs, each model checked to be installed."""
    from localrun import api
    from localrun.errors import UsageError

    out = []
    for value in values:
        pattern, sep, model = value.partition("=")
        if not sep or not pattern.strip() or not model.strip():
            raise UsageError(f"invalid --alias {value!r}", "give PATTERN=MODEL, e.g. 'claude-haiku-*=qwen3:4b'")
        api.get_model(model.strip())
        out.append((pattern.strip(), model.strip()))
    return tuple(out)


def bind(host: str, port: int) -> Any:
    """A listening socket on host:port, or an error naming who holds the port."""
    import errno
    import socket

    from localrun.errors import LocalrunError

    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise LocalrunError(f"cannot listen on {where}: {e.strerror}", "pass an IP address or a local host name to --host") from e
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise LocalrunError(f"another server, perhaps Ollama, is listening on {where}", "use --port") from e
        raise LocalrunError(f"cannot listen on {where}: {e.strerror}", "choose another --host or --port") from e
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the installed models over HTTP: the OpenAI API under /v1 and Ollama's under /api, on
    127.0.0.1:11434 by default so that Ollama clients work unchanged. Models load on their first
    request and stay loaded for --keep-alive; each runs --parallel requests at once."""
    import dataclasses
    import signal
    import threading

    from localrun.errors import UsageError

    if getattr(args, "mmproj", None):
        raise UsageError("serve loads many models: a projector is recorded with its model",
                         "register it once with 'localrun add MODEL.gguf --mmproj FILE'")
    if args.media_dir and not os.path.isdir(args.media_dir):
        raise UsageError(f"--media-dir {args.media_dir}: no such folder")
    if args.max_queue < 0:
        raise UsageError(f"invalid value for --max-queue: {args.max_queue}", "expected an integer >= 0 (0: unbounded)")
    options = dataclasses.replace(load_options_from_args(args, n_parallel=args.parallel), max_queue=args.max_queue,
                                  cache_ram=args.cache_ram, draft_optional=True)
    key = args.api_key or os.environ.get("LOCALRUN_API_KEY") or None
    origins = tuple(o for value in args.origins for o in value.split(",") if o.strip())
    sock = bind(args.host, args.port)
    try:
        import uvicorn

        from localrun import api, settings
        from localrun.server import is_loopback
        from localrun.server.app import ServerConfig, create_app

        config = ServerConfig(host=args.host, port=sock.getsockname()[1], api_key=key, origins=origins, allow_pull=args.allow_pull,
                              lora=_default_adapters(args.lora), settings=settings.from_args(args),
                              aliases=_aliases(args.alias),
                              media_dir=os.path.realpath(args.media_dir) if args.media_dir else None,
                              allow_fetch=args.allow_fetch, mcp=api.mcp_servers(args.mcp) if args.mcp else None)
        err = sys.stderr
        warned: set[tuple[str, str]] = set()

        def on_load(model: ModelInfo, session: Session) -> None:
            # What the engine warns of about a model (a projector gone, one llama.cpp reads otherwise
            # than trained), said once per model in the server's log, not at every reload.
            warning = session.info().get("warning")
            if warning and (model.name, warning) not in warned:
                warned.add((model.name, warning))
                print(f"localrun: warning: '{model.name}': {warning}", file=err, flush=True)

        pool = api.model_pool(options, engine=args.engine, max_loaded=args.max_loaded, keep_alive=args.keep_alive,
                              on_load=on_load)
        if not is_loopback(args.host):
            print(f"localrun: warning: listening on {args.host} makes your models reachable from other machines"
                  + ("" if key else "; set --api-key to require a key"), file=err)
        port = sock.getsockname()[1]  # the real one when --port 0
        url = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{port}"
        ready = f"localrun: serving on {url} (OpenAI API at {url}/v1, Ollama API at {url}/api); Ctrl-C stops"

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets)
                # Said once the server answers and Ctrl-C / SIGTERM stop it cleanly (uvicorn's
                # handlers are in place): whoever waits for this line may use the server or stop it.
                print(ready, file=err, flush=True)

        server = Server(uvicorn.Config(create_app(pool, config), log_level="warning", access_log=False,
                                       timeout_graceful_shutdown=3))
        # uvicorn shuts down gracefully on Ctrl-C / SIGTERM, then raises the signal again: stopping
        # the server that way is its normal end, and the pool must still unload its engines.
        previous = signal.signal(signal.SIGTERM, _stop) if threading.current_thread() is threading.main_thread() else None
        try:
            server.run(sockets=[sock])
        except (KeyboardInterrupt, SystemExit):
            pass
        finally:
            pool.close()
            if config.mcp is not None:
                config.mcp.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()
    return 0


def _default_adapters(specs: list[str]) -> tuple[tuple[str, float], ...]:
    """`serve --lora NAME[:SCALE]`: registered adapters with a base, checked before serving."""
    from localrun import adapters, api
    from localrun.errors import UsageError

    out = []
    for spec in specs:
        name, scale = adapters.parse_spec(spec)
        info = adapters.find_adapter(api.store(), name)
        if not info.is_adapter or info.format != "gguf" or info.source == "path":
            raise UsageError(f"--lora {spec}: serve applies adapters registered in the store",
                             "convert and register it first: localrun convert ADAPTER_DIR")
        adapters.base_of(api.store(), info)  # fails now when its base is not installed
        out.append((info.name, scale))
    return tuple(out)


def _stop(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def cmd_ps(args: argparse.Namespace) -> int:
    """List the models a running `localrun serve` (or Ollama) has loaded, and when each unloads."""
    import json
    import urllib.error
    import urllib.request

    from localrun.errors import LocalrunError

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    where = f"[{host}]:{args.port}" if ":" in host else f"{host}:{args.port}"
    req = urllib.request.Request(f"http://{where}/api/ps")
    key = args.api_key or os.environ.get("LOCALRUN_API_KEY")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            data = json.loads(res.read())
    except urllib.error.HTTPError as e:
        hint = "pass --api-key or set LOCALRUN_API_KEY" if e.code == 401 else None
        raise LocalrunError(f"the server on {where} answered {e.code}: {_error_text(e)}", hint) from e
    except (urllib.error.URLError, OSError) as e:
        raise LocalrunError(f"no server is listening on {where}", "start one with 'localrun serve', or pass --host/--port") from e
    except ValueError as e:
        raise LocalrunError(f"the server on {where} sent an answer that is not JSON") from e
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    models = data.get("models") or []
    if not models:
        print("no models loaded", file=sys.stderr)
        return 0
    _print_table(models)
    return 0


def _error_text(e: Any) -> str:
    import json

    try:
        body = json.loads(e.read())
        err = body.get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return str(e.reason)


def _print_table(models: list[dict[str, Any]]) -> None:
    from localrun import units

    rows = [("NAME", "SIZE", "CONTEXT", "UNTIL")]
    for m in models:
        rows.append((str(m.get("name") or m.get("model")), units.size(m.get("size")),
                     str(m.get("context_length") or "-"), _until(m.get("expires_at"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _until(stamp: str | None) -> str:
    """'in 4m32s', or 'forever' for Ollama's far-future expiry."""
    import re
    from datetime import datetime, timezone

    from localrun import units

    if not stamp:
        return "-"
    text = re.sub(r"(\.\d{6})\d+", r"\1", stamp.replace("Z", "+00:00"))
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return stamp
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    seconds = (when - datetime.now(timezone.utc)).total_seconds()
    if seconds > 100 * 365 * 86400:
        return "forever"
    return "now" if seconds <= 0 else f"in {units.duration(seconds)}"
