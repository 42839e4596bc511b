"""`localrun batch --ray`: the same batch on a Ray cluster.

The driver (the `localrun batch` process) reads the rows, resolves the model and splits the rows
into blocks. A pool of Ray actors, each holding one loaded model behind localrun's own engine loop
(so each actor runs its rows as parallel sequences, as a local batch does), works through the
blocks, two at a time, and streams each finished row back. The driver writes every row as it
arrives, so `--resume` works as it does locally and every id is written exactly once. An actor
that dies (killed, out of memory, engine crash) has the unfinished rows of its blocks retried on
another actor, up to a limit, after which they get error records. Ray is imported only here.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.batch import BatchRow, Meter, Progress, Record, key
from localrun.errors import BackendUnavailableError, LocalrunError, UsageError
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo, hf_cache_dir

INSTALL_HINT = "install it with: pip install 'localrun[ray]'"
IN_FLIGHT = 2  # blocks an actor holds at once, so that it never waits for its next block
_HF_PATH = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<rev>[0-9a-f]{40})/(?P<file>.+)$")


@dataclass(frozen=True)
class RayOptions:
    """How the batch uses the cluster."""

    address: str | None = None  # None: start a local cluster; "auto": the running one; or HOST:PORT / ray://...
    actors: int | None = None  # None: one per GPU (with GPUs per actor), else one per node
    gpus_per_actor: float = 0.0
    cpus_per_actor: float | None = None  # None: with actors given, 1; else a whole node
    model_path: str | None = None  # the model at this path on every node (shared storage)
    retries: int = 2  # attempts beyond the first for a block whose actor died
    block_rows: int | None = None  # rows per block (default: twice the actor's parallel sequences)


def require_ray() -> None:
    """Raise UsageError with the install hint when Ray cannot be imported (without importing it)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("ray") is not None
    except ValueError:  # a module set to None in sys.modules: not importable
        found = False
    if not found:
        raise UsageError("--ray needs Ray, which is not installed", INSTALL_HINT)


def import_ray(address: str | None = "auto") -> Any:
    """Ray, imported for a cluster at `address` (None: a local one this process starts)."""
    host = (address or "").removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    if "ray" not in sys.modules and (not address or host in ("127.0.0.1", "localhost", "::1")):
        # A cluster on this machine's loopback, or the local one started here: Ray then stays on
        # the loopback address instead of replacing it with the machine's network address.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as e:
        raise UsageError("--ray needs Ray, which is not installed", INSTALL_HINT) from e
    return ray


# -- the model on each node ---------------------------------------------------------------------


def hub_source(path: str) -> tuple[str, str, str] | None:
    """(repo, revision, file) of a file in a Hugging Face cache, from its path."""
    m = _HF_PATH.search(Path(path).as_posix())
    return (f"{m['org']}/{m['name']}", m["rev"], m["file"]) if m else None


def locate(model: ModelInfo, model_path: str | None) -> ModelInfo:
    """The model as this node has it: --model-path, the node's own Hugging Face cache (pulled there,
    verified, when missing), or the driver's path when this node sees the same file."""
    node = socket.gethostname()
    if model_path:
        if not os.path.exists(model_path):
            raise UsageError(f"--model-path {model_path} does not exist on node {node}",
                             "put the model on storage every node mounts at the same path")
        return dataclasses.replace(model, path=model_path)
    source = hub_source(model.path)
    if source is not None:
        repo, revision, filename = source
        local = hf_cache_dir() / f"models--{repo.replace('/', '--')}" / "snapshots" / revision / filename
        if local.exists():
            return dataclasses.replace(model, path=str(local))
        from localrun import hub

        try:
            pulled = hub.pull(f"{repo}:{filename}", revision)
        except LocalrunError as e:  # the node's own reason is in the message: Ray reports only this error
            raise BackendUnavailableError(f"node {node} cannot get {repo}/{filename}: {e.message}",
                                          "let every node reach the Hub, or pass --model-path on shared storage") from None
        return dataclasses.replace(model, path=pulled.model.path)
    if os.path.exists(model.path):
        return model
    raise BackendUnavailableError(f"node {node} does not have the model file {model.path}",
                                  "put it on storage every node mounts and pass --model-path, or pull it from the Hub")


class BatchActor:
    """One loaded model on a cluster node (wrapped by ray.remote when the batch starts)."""

    def __init__(self, model: ModelInfo, options: LoadOptions, engine: str | None, model_path: str | None) -> None:
        import ray

        from localrun.backends.selection import choose_engine
        from localrun.backends.session import WorkerSession

        self.node = f"{socket.gethostname()} (node {ray.get_runtime_context().get_node_id()[:8]})"
        here = locate(model, model_path)
        self.session = WorkerSession(choose_engine(here, engine), here, options)

    def describe(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "engine_pid": self.session.pid, "node": self.node}

    def run(self, rows: list[BatchRow], params: GenerationParams) -> Iterator[Record]:
        """Each row's record as it finishes (a streaming generator on the driver's side)."""
        from localrun import batch

        yield from batch.run_rows(self.session, rows, params)


# -- the driver -----------------------------------------------------------------------------------


@dataclass
class _Block:
    rows: list[BatchRow]
    attempts: int = 0


@dataclass
class _Actor:
    index: int
    handle: Any
    pid: int | None = None
    node: str = ""
    busy: int = 0
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0  # time with at least one block in flight
    since: float = 0.0
    dead: str | None = None


@dataclass
class Summary:
    """What each actor did, for the batch's report."""

    actors: list[dict[str, Any]] = field(default_factory=list)
    retried_blocks: int = 0
    start_seconds: float = 0.0  # connecting to (or starting) the cluster and loading the models


def _plan_actors(ray: Any, opts: RayOptions) -> tuple[int, float, float]:
    """(actors, CPUs each, GPUs each) for this cluster."""
    res = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    gpus = opts.gpus_per_actor
    if opts.actors is not None:
        cpus = opts.cpus_per_actor or 1.0
        return opts.actors, cpus, gpus
    if gpus > 0:
        return max(1, int(res.get("GPU", 0) // gpus)), opts.cpus_per_actor or 1.0, gpus
    if opts.cpus_per_actor:
        return max(1, int(res.get("CPU", 1) // opts.cpus_per_actor)), opts.cpus_per_actor, 0.0
    per_node = min((n.get("Resources", {}).get("CPU", 1.0) for n in nodes), default=1.0)
    return max(1, len(nodes)), max(1.0, per_node), 0.0


def run(model: ModelInfo, rows: list[BatchRow], params: GenerationParams, options: LoadOptions,
        engine: str | None, opts: RayOptions, *, cancel: Any = None,
        progress: Callable[[Progress], None] | None = None, notice: Callable[[str], None] | None = None,
        summary: Summary | None = None) -> Generator[Record, None, None]:
    """Run the rows on the cluster; yield each row's record as it arrives (bad rows first)."""
    ray = import_ray(opts.address)
    say = notice or (lambda line: None)
    summary = summary if summary is not None else Summary()
    meter = Meter(rows, progress)
    yield from meter.bad_rows()
    runnable = [r for r in rows if r.request is not None]
    if not runnable:
        return
    started_here = not ray.is_initialized()
    actors: list[_Actor] = []
    if started_here:
        _init(ray, opts.address)
    try:
        n_actors, cpus, gpus = _plan_actors(ray, opts)
        n_actors = max(1, min(n_actors, len(runnable)))
        if options.n_threads is None:
            options = dataclasses.replace(options, n_threads=max(1, int(cpus)))
        size = opts.block_rows or max(1, 2 * options.n_parallel)
        size = min(size, max(1, math.ceil(len(runnable) / n_actors)))
        blocks = deque(_Block(runnable[i:i + size]) for i in range(0, len(runnable), size))
        remote = ray.remote(BatchActor)

        def spawn(index: int) -> _Actor:
            handle = remote.options(num_cpus=cpus, num_gpus=gpus, max_concurrency=IN_FLIGHT + 1,
                                    scheduling_strategy="SPREAD").remote(model, options, engine, opts.model_path)
            return _Actor(index, handle)

        actors += [spawn(i) for i in range(n_actors)]
        say(f"ray: {n_actors} actor(s), {cpus:g} CPU(s){f' and {gpus:g} GPU(s)' if gpus else ''} each, "
            f"{len(blocks)} block(s) of up to {size} rows")
        for a, info in zip(actors, _describe(ray, actors), strict=True):
            if isinstance(info, dict):
                a.pid, a.node = info["pid"], info["node"]
                say(f"ray: actor {a.index} ready (pid {a.pid} on {a.node})")
            else:
                a.dead = info
                say(f"ray: actor {a.index} failed to start: {info}")
        summary.start_seconds = time.perf_counter() - meter.t0
        inflight: dict[Any, tuple[_Actor, _Block, set[str]]] = {}
        while blocks or inflight:
            if cancel is not None and cancel.is_set():
                return  # the actors are killed below: their unfinished rows stay for --resume
            live = [a for a in actors if a.dead is None]
            if not live and not inflight:
                reason = "; ".join(sorted({a.dead for a in actors if a.dead})) or "no actor is alive"
                while blocks:
                    for r in blocks.popleft().rows:
                        meter.finished({})
                        yield {"id": r.id, "error": f"no actor could run this row: {reason}"}
                meter.tick()
                return
            while blocks:  # the next block to the least busy actor: every actor gets work
                free = [a for a in live if a.busy < IN_FLIGHT]
                if not free:
                    break
                a = min(free, key=lambda a: (a.busy, a.index))
                block = blocks.popleft()
                block.attempts += 1
                gen = a.handle.run.options(num_returns="streaming").remote(block.rows, params)
                if a.busy == 0:
                    a.since = time.perf_counter()
                a.busy += 1
                inflight[gen] = (a, block, set())
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for gen in ready:
                a, block, got = inflight[gen]
                try:
                    ref = next(gen)
                    record = ray.get(ref)
                except StopIteration:
                    inflight.pop(gen)
                    _idle(a)
                    continue
                except Exception as e:  # noqa: BLE001 - the actor died (killed, out of memory, engine crash)
                    inflight.pop(gen)
                    _idle(a)
                    if a.dead is None:
                        a.dead = _reason(e)
                        say(f"ray: actor {a.index} (pid {a.pid} on {a.node}) died: {a.dead}")
                    rest = [r for r in block.rows if key(r.id) not in got]
                    if block.attempts > opts.retries:
                        for r in rest:
                            meter.finished({})
                            yield {"id": r.id, "error": f"its actor died {block.attempts} times: {a.dead}"}
                        meter.tick()
                    else:
                        summary.retried_blocks += 1
                        blocks.appendleft(_Block(rest, block.attempts))
                    continue
                got.add(key(record.get("id")))
                a.rows += 1
                a.tokens += int(record.get("completion_tokens") or 0)
                meter.finished(record)
                yield record
                meter.tick()
    finally:
        for a in actors:
            if a.busy > 0:  # stopped or failed with blocks in flight: count the time they ran
                a.seconds += time.perf_counter() - a.since
        summary.actors = [{"actor": a.index, "pid": a.pid, "node": a.node, "rows": a.rows, "tokens": a.tokens,
                           "seconds": round(a.seconds, 3), "tokens_per_second": a.tokens / a.seconds if a.seconds else 0.0,
                           "error": a.dead} for a in actors]
        for a in actors:
            try:
                ray.kill(a.handle)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if started_here:
            ray.shutdown()


def _idle(a: _Actor) -> None:
    a.busy -= 1
    if a.busy == 0:
        a.seconds += time.perf_counter() - a.since


def _describe(ray: Any, actors: list[_Actor]) -> list[dict[str, Any] | str]:
    """Each actor's pid and node once its model is loaded, or why it could not load it."""
    out: list[dict[str, Any] | str] = []
    for a in actors:
        try:
            out.append(ray.get(a.handle.describe.remote()))
        except Exception as e:  # noqa: BLE001 - its constructor failed
            out.append(_reason(e))
    return out


def _reason(e: BaseException) -> str:
    """One line from a Ray error: the localrun error inside it when there is one."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, LocalrunError):
        return str(cause.message)
    text = str(e)
    for line in text.splitlines():
        m = re.search(r"(?:localrun\.errors\.\w+|\w+Error): (.+)", line)
        if m and "localrun" in line:
            return m.group(1).strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)
    return first[:300]


def _init(ray: Any, address: str | None) -> None:
    """Connect to the cluster (`auto`, an address) or start a local one for trying it out."""
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "error"}
    try:
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(address="local", include_dashboard=False, **kwargs)  # a new cluster, never a running one
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = f"the Ray cluster at {address}" if address else "a local Ray cluster"
        raise BackendUnavailableError(f"cannot connect to {where}: {str(e).splitlines()[0] if str(e) else e}",
                                      "start one with 'ray start --head', or give its address: --ray HOST:6379") from e
