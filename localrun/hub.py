"""Hub search and pull, on huggingface_hub and its cache.

A pull resolves `REPO[:QUANT|:FILE]` to a set of files at one commit, estimates whether the model
fits this machine, downloads what the cache lacks (localrun.download: ranged, resumable,
verified), links the files into the cache's snapshot only when all of them are complete, and
registers the model in the store under a short name. A GGUF repository that publishes vision
projectors (mmproj files) has the matching one fetched with the model and recorded with its entry.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from localrun.download import Blob, Cancel, Progress, ProgressFn, fetch, hash_file, partial_path
from localrun.errors import HubError, UsageError
from localrun.fit import FitEstimate
from localrun.repofiles import (
    RepoFile,
    choose_projector,
    default_name,
    detect_quant,
    projector_choices,
    select,
    split_of,
)
from localrun.store import ModelInfo, Store, hf_cache_dir
from localrun.system import disk_full

NoticeFn = Callable[[str], None]
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
FORMATS = ("gguf", "mlx", "safetensors")


@dataclass(frozen=True)
class RepoSummary:
    """A search result."""

    id: str
    downloads: int | None
    likes: int | None
    last_modified: str | None  # ISO 8601
    formats: tuple[str, ...]
    gated: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"id": self.id, "downloads": self.downloads, "likes": self.likes,
                "last_modified": self.last_modified, "formats": list(self.formats), "gated": self.gated}



@dataclass(frozen=True)
class PullPlan:
    """The files one pull needs, at one commit."""

    repo: str
    revision: str
    commit: str
    format: str  # "gguf", "mlx" or "safetensors"
    files: tuple[RepoFile, ...]
    quant: str | None
    name: str
    from_cache: bool = False  # listed from the local cache (offline, or the Hub unreachable)
    projector: RepoFile | None = None  # a vision model's projector, fetched with its files
    projector_choices: tuple[str, ...] = ()  # the projectors it was chosen from

    @property
    def downloads(self) -> tuple[RepoFile, ...]:
        """Every file the pull fetches: the model's, then its projector."""
        return self.files + ((self.projector,) if self.projector else ())

    @property
    def size(self) -> int:
        return sum(f.size for f in self.downloads)

    @property
    def snapshot(self) -> Path:
        return repo_cache_dir(self.repo) / "snapshots" / self.commit

    @property
    def model_path(self) -> Path:
        """What the store registers: the (first) GGUF file, or the snapshot folder."""
        return self.snapshot / self.files[0].path if self.format == "gguf" else self.snapshot

    @property
    def projector_path(self) -> Path | None:
        """Where the projector lies once pulled (recorded as the entry's mmproj)."""
        return self.snapshot / self.projector.path if self.projector else None


@dataclass(frozen=True)
class PullResult:
    """What a pull installed."""

    model: ModelInfo
    plan: PullPlan
    downloaded_bytes: int
    already_installed: bool
    notices: tuple[str, ...] = field(default=())


# -- helpers ---------------------------------------------------------------------------------
def endpoint() -> str:
    """The Hub URL: $HF_ENDPOINT at call time (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def is_offline() -> bool:
    """HF_HUB_OFFLINE, read now or when huggingface_hub was imported."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return value.upper() in ("1", "ON", "YES", "TRUE") or constants.is_offline_mode()


def repo_cache_dir(repo: str) -> Path:
    return hf_cache_dir() / ("models--" + repo.replace("/", "--"))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`org/name[:QUANT|:FILE]` (also with an `hf.co/` or `https://huggingface.co/` prefix)."""
    text = spec.strip()
    text = re.sub(r"^(https?://)?(www\.)?(hf\.co|huggingface\.co)/", "", text)
    repo, _, selector = text.partition(":")
    repo = repo.strip("/")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*", repo):
        raise UsageError(f"'{spec}' is not a Hub repository", "use ORG/NAME[:QUANT], e.g. 'Qwen/Qwen3-0.6B-GGUF:Q4_K_M'")
    return repo, selector or None


@contextmanager
def hub_errors(repo: str, what: str = "") -> Iterator[None]:
    """Turn huggingface_hub and network errors into HubError messages that name the next step."""
    import httpx2
    from huggingface_hub import errors as e

    where = f"'{repo}'" + (f" ({what})" if what else "")
    try:
        yield
    except e.GatedRepoError as err:
        status = err.response.status_code if err.response is not None else 401
        who = "no Hugging Face token was sent" if status == 401 else "your Hugging Face token has no access to it"
        raise HubError(
            f"'{repo}' is a gated repository and {who}",
            f"request access at {endpoint()}/{repo}, then set HF_TOKEN or run 'hf auth login'",
        ) from err
    except e.RevisionNotFoundError as err:
        raise HubError(f"{where}: this revision does not exist", "check --revision (a branch, tag or commit)") from err
    except e.RemoteEntryNotFoundError as err:
        raise HubError(f"{where}: the file does not exist", f"run 'localrun search --files {repo}'") from err
    except e.RepositoryNotFoundError as err:
        raise HubError(
            f"repository '{repo}' was not found on the Hub",
            "check the name with 'localrun search'; if it is private, set HF_TOKEN or run 'hf auth login'",
        ) from err
    except e.OfflineModeIsEnabled as err:
        raise HubError(f"{where} needs the Hub but HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE") from err
    except e.HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else 0
        if status == 401:
            raise HubError(f"the Hub refused the token for {where} (401)",
                           "check HF_TOKEN or run 'hf auth login' again") from err
        if status == 403:
            raise HubError(f"access to {where} is forbidden (403)",
                           f"request access at {endpoint()}/{repo} or use a token with read permission") from err
        raise _Unreachable(f"the Hub answered {status or 'an error'} for {where}",
                           "try again later, or set HF_HUB_OFFLINE=1 to use what is already downloaded") from err
    except httpx2.TransportError as err:
        raise _Unreachable(f"cannot reach the Hub at {endpoint()} for {where}: {str(err) or type(err).__name__}",
                           "check the connection, or set HF_HUB_OFFLINE=1 to use models already downloaded") from err


class _Unreachable(HubError):
    """The Hub could not answer (network down, 5xx): a cached copy may stand in, with a notice."""


# -- search and listing -------------------------------------------------------------------------
def search(query: str, fmt: str | None = None, sort: str = "downloads", limit: int = 20) -> list[RepoSummary]:
    """Hub repositories matching a query, most downloaded (or liked, or recently updated) first."""
    from huggingface_hub import HfApi

    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"unknown format '{fmt}'", f"use one of {', '.join(FORMATS)}")
    sorts = {"downloads": "downloads", "likes": "likes", "updated": "last_modified"}
    if sort not in sorts:
        raise UsageError(f"unknown sort '{sort}'", f"use one of {', '.join(sorts)}")
    if limit < 1:
        raise UsageError(f"--limit must be at least 1, not {limit}")
    if is_offline():
        raise HubError("search needs the Hub but HF_HUB_OFFLINE is set", "unset HF_HUB_OFFLINE")
    api = HfApi(endpoint=endpoint())
    with hub_errors("search"):
        items = list(api.list_models(
            search=query or None, filter=fmt, sort=sorts[sort], limit=limit,  # type: ignore[arg-type]
            expand=["downloads", "likes", "lastModified", "tags", "gated", "library_name"],
        ))
    out = []
    for m in items:
        tags = set(m.tags or [])
        formats = tuple(f for f in FORMATS if f in tags or m.library_name == f)
        out.append(RepoSummary(m.id, m.downloads, m.likes, m.last_modified.isoformat() if m.last_modified else None,
                               formats, bool(m.gated)))
    return out


def list_files(repo: str, revision: str | None = None) -> tuple[str, list[RepoFile], dict[str, Any]]:
    """(commit, files, repo facts) from the Hub, with sizes, digests and GGUF quantizations."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint())
    with hub_errors(repo, f"revision {revision}" if revision else ""):
        info = api.model_info(repo, revision=revision, files_metadata=True)
    files = []
    for s in info.siblings or []:
        gguf = s.rfilename.lower().endswith(".gguf")
        files.append(RepoFile(
            s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0)), s.lfs.sha256 if s.lfs else None, s.blob_id,
            detect_quant(s.rfilename) if gguf else None, split_of(s.rfilename) if gguf else None,
        ))
    facts = {"tags": list(info.tags or []), "library_name": info.library_name, "gated": info.gated}
    return str(info.sha), files, facts


def cached_files(repo: str, revision: str | None = None) -> tuple[str, list[RepoFile]] | None:
    """(commit, complete files) of a repository in the local cache, or None."""
    folder = repo_cache_dir(repo)
    rev = revision or "main"
    commit = rev if _COMMIT.match(rev) else None
    ref = folder / "refs" / rev
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    snapshot = folder / "snapshots" / (commit or "")
    if commit is None or not snapshot.is_dir():
        return None
    files = []
    for p in sorted(snapshot.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(snapshot).as_posix()
        blob = p.resolve().name
        gguf = rel.lower().endswith(".gguf")
        files.append(RepoFile(rel, p.stat().st_size, blob if len(blob) == 64 else None,
                              blob if len(blob) == 40 else None,
                              detect_quant(rel) if gguf else None, split_of(rel) if gguf else None))
    return commit, files


@dataclass(frozen=True)
class RepoListing:
    """A repository's files at one commit, with the files a plain pull would fetch."""

    repo: str
    commit: str
    files: tuple[RepoFile, ...]
    format: str | None
    default: tuple[str, ...]  # paths a pull without :QUANT fetches
    default_quant: str | None


def _offline_files(repo: str, revision: str | None, then: str) -> tuple[str, list[RepoFile]]:
    """(commit, files) of a repository from the cache, for HF_HUB_OFFLINE=1."""
    cached = cached_files(repo, revision)
    if cached is None:
        raise HubError(f"'{repo}' is not in the Hugging Face cache and HF_HUB_OFFLINE is set",
                       f"unset HF_HUB_OFFLINE to {then}")
    return cached


def listing(spec: str, revision: str | None = None) -> RepoListing:
    """List a repository (from the cache when offline) and mark the default pull."""
    repo, _ = parse_spec(spec)
    facts: dict[str, Any] = {}
    if is_offline():
        commit, files = _offline_files(repo, revision, "list it from the Hub")
    else:
        commit, files, facts = list_files(repo, revision)
    try:
        fmt, chosen, quant = select(repo, files, None, facts)
    except HubError:
        fmt, chosen, quant = None, [], None
    projector = choose_projector(projector_choices(files, chosen)) if fmt == "gguf" else None
    chosen = [*chosen, projector] if projector else chosen
    return RepoListing(repo, commit, tuple(files), fmt, tuple(f.path for f in chosen), quant)


# -- choosing files -------------------------------------------------------------------------------
def plan(spec: str, revision: str | None = None, name: str | None = None,
         notice: NoticeFn | None = None) -> PullPlan:
    """Resolve `REPO[:QUANT|:FILE]` to the files of one commit (the cache when offline or unreachable)."""
    repo, selector = parse_spec(spec)
    rev = revision or "main"
    facts: dict[str, Any] = {}
    from_cache = False
    if is_offline():
        commit, files = _offline_files(repo, revision, "download it")
        from_cache = True
    else:
        try:
            commit, files, facts = list_files(repo, revision)
        except _Unreachable as err:
            cached = cached_files(repo, revision)
            if cached is None:
                raise
            commit, files = cached
            from_cache = True
            if notice:
                notice(f"{err.message}; using the copy cached at commit {commit[:7]}")
    if from_cache:
        snapshot = repo_cache_dir(repo) / "snapshots" / commit
        config = snapshot / "config.json"
        if config.exists() and "quantization" in config.read_text(errors="replace"):
            facts = {"tags": ["mlx"]}
    try:
        fmt, chosen, quant = select(repo, files, selector, facts)
    except HubError as e:
        if not from_cache:
            raise
        raise HubError(f"{e.message} in the cached copy", f"{e.hint}; or download it with the Hub reachable"
                       " (HF_HUB_OFFLINE unset)" if e.hint else "unset HF_HUB_OFFLINE to download it") from e
    choices = projector_choices(files, chosen) if fmt == "gguf" else []
    return PullPlan(repo, rev, commit, fmt, tuple(chosen), quant, name or default_name(repo, fmt, quant), from_cache,
                    choose_projector(choices), tuple(f.path for f in choices))


# -- fit -----------------------------------------------------------------------------------------
def _auth_headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(library_name="localrun")


def _file_url(repo: str, commit: str, path: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo, path, revision=commit, endpoint=endpoint())


def read_range(repo: str, commit: str, path: str) -> Callable[[int, int], bytes]:
    """A function reading bytes [start, start+n) of a remote file with one HTTP range request."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    url = _file_url(repo, commit, path)

    def read(start: int, n: int) -> bytes:
        headers = {**_auth_headers(), "Range": f"bytes={start}-{start + n - 1}", "Accept-Encoding": "identity"}
        with hub_errors(repo, path), get_session().stream("GET", url, headers=headers, timeout=30) as r:
            if r.status_code >= 400:
                r.read()
                hf_raise_for_status(r)
            out = bytearray()
            for chunk in r.iter_raw():
                out += chunk
                if len(out) >= n:
                    break
            return bytes(out[:n])

    return read


def estimate_fit(p: PullPlan, context: int | None = None, cpu_moe: int | str = 0) -> FitEstimate:
    """Memory the planned model needs at `context` tokens, and whether this machine has it; with
    cpu_moe (--cpu-moe N or 'all') the expert weights of those layers count toward host memory."""
    import json

    from localrun import fit

    weights = sum(f.size for f in p.files if f.is_weights)
    local = p.model_path
    parameters: int | None = None
    active: int | None = None
    experts: fit.Experts | None = None
    if p.format == "gguf":
        first = p.files[0]
        if local.exists():
            from localrun.gguf_header import read_gguf

            meta = read_gguf(local)
        else:
            fit.check_header_size(first.size, first.path)
            meta = fit.read_remote_gguf(first.path, first.size, read_range(p.repo, p.commit, first.path))
        shape = fit.shape_from_gguf(meta)
        parameters, active, experts = fit.parameters_from_gguf(meta, weights)
    else:
        if (local / "config.json").exists():
            raw = (local / "config.json").read_bytes()
        else:
            cfg = next(f for f in p.files if f.path == "config.json")
            raw = read_range(p.repo, p.commit, cfg.path)(0, max(cfg.size, 1))
        try:
            shape = fit.shape_from_config(json.loads(raw))
        except ValueError as e:
            raise HubError(f"the config.json of '{p.repo}' is not valid JSON: {e}") from e
    projector = p.projector.size if p.projector else 0  # its weights load with the model
    est = fit.estimate(p.repo, tuple(f.path for f in p.files), weights, shape, context, parameters, active, experts,
                       cpu_moe, projector_bytes=projector)
    return replace(est, projector=p.projector.path if p.projector else None, download_bytes=p.size)


# -- pull -----------------------------------------------------------------------------------------
def _installed(p: PullPlan, store: Store) -> ModelInfo | None:
    """The store's model for this plan when it is already registered at the same path."""
    from localrun.errors import ModelNotFoundError

    try:
        info = store.get(p.name)
    except (ModelNotFoundError, HubError):
        return None
    except Exception:  # noqa: BLE001 - a broken entry is reinstalled below
        return None
    same = os.path.realpath(info.path) == os.path.realpath(p.model_path)
    complete = all((p.snapshot / f.path).exists() for f in p.downloads)
    # A vision model pulled before its projector was fetched gets it now.
    projector = p.projector is None or bool(info.details.get("mmproj"))
    return info if same and complete and projector and info.source == "hub" else None


def _check_disk(p: PullPlan, blobs: Path) -> None:
    missing = 0
    for f in p.downloads:
        blob = blobs / (f.sha256 or f.blob_id or "")
        if not blob.exists():
            part = partial_path(blob)
            missing += f.size - (part.stat().st_size if part.exists() else 0)
    probe = blobs
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    margin = 64 << 20
    if missing + margin > free:
        raise HubError(
            f"not enough disk space to pull '{p.repo}': it needs {human_size(missing)}"
            f" and {probe} has {human_size(free)} free",
            "free some space, or set HF_HUB_CACHE to a folder on a larger disk",
        )


def _link(blob: Path, pointer: Path) -> None:
    """Point a snapshot entry at its blob atomically (a relative symlink, as huggingface_hub does)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:
        shutil.copyfile(blob, tmp)  # no symlinks here (Windows without developer mode)
    os.replace(tmp, pointer)


def _write_ref(folder: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = folder / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if ref.exists() and ref.read_text().strip() == commit:
        return
    tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
    tmp.write_text(commit)
    os.replace(tmp, ref)


def download(p: PullPlan, progress: ProgressFn | None = None, cancel: Cancel | None = None) -> int:
    """Fetch and verify every planned file into the cache, then link the snapshot; returns bytes fetched."""
    from huggingface_hub.utils import WeakFileLock, get_session, hf_raise_for_status

    folder = repo_cache_dir(p.repo)
    blobs = folder / "blobs"
    snapshot = folder / "snapshots" / p.commit
    _check_disk(p, blobs)
    headers = _auth_headers()
    fetched = 0
    for f in p.downloads:
        digest = f.sha256 or f.blob_id
        if not digest:
            raise HubError(f"the Hub lists no checksum for '{f.path}' in '{p.repo}'", "try again later")
        blob = Blob(f.path, _file_url(p.repo, p.commit, f.path), f.size, f.sha256, None if f.sha256 else f.blob_id)
        dest = blobs / blob.etag
        lock = hf_cache_dir() / ".locks" / folder.name / f"{blob.etag}.lock"
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            if dest.exists():
                # A blob another tool downloaded: huggingface_hub checked only its size.
                if dest.stat().st_size != f.size or hash_file(dest, blob, progress, cancel) != blob.etag:
                    dest.unlink()
            if dest.exists():
                if progress:
                    progress(Progress(f.path, f.size, f.size, 0.0, 0.0, f.size, "cached"))
                continue
            try:
                with hub_errors(p.repo, f.path):
                    fetched += fetch(blob, dest, headers=headers, session=get_session(),
                                     raise_for_status=hf_raise_for_status, progress=progress, cancel=cancel)
            except OSError as e:
                if (full := disk_full(e, blobs)) is None:
                    raise
                disk, state = full
                part = partial_path(dest)
                kept = part.stat().st_size if part.exists() else 0
                raise HubError(
                    f"cannot download '{f.path}' of '{p.repo}': the disk at {disk} is {state}; {kept} of {f.size}"
                    " bytes are kept and nothing was installed",
                    f"free some space on {disk} (or set HF_HUB_CACHE to a larger disk),"
                    " then run the same pull again: it resumes where it stopped",
                ) from e
    # Only now, with every file complete and verified, does the model appear in the snapshot.
    for f in p.downloads:
        _link(blobs / (f.sha256 or f.blob_id or ""), snapshot / f.path)
    _write_ref(folder, p.revision, p.commit)
    return fetched


def pull(spec: str, revision: str | None = None, name: str | None = None, *,
         progress: ProgressFn | None = None, cancel: Cancel | None = None, notice: NoticeFn | None = None,
         check_fit: bool = True, context: int | None = None, store: Store | None = None) -> PullResult:
    """Download (or find in the cache) a model and register it in the store."""
    notices: list[str] = []

    def tell(message: str) -> None:
        notices.append(message)
        if notice:
            notice(message)

    store = store or Store()
    p = plan(spec, revision, name, tell)
    installed = _installed(p, store)
    if installed is not None:
        return PullResult(installed, p, 0, True, tuple(notices))
    fetched = 0
    if p.from_cache:
        missing = [f.path for f in p.downloads if not (p.snapshot / f.path).exists()]
        if missing:
            raise HubError(f"the cached copy of '{p.repo}' lacks {', '.join(missing)}",
                           "unset HF_HUB_OFFLINE and pull again when the Hub is reachable")
    else:
        if check_fit:
            _warn_fit(p, context, tell)
        fetched = download(p, progress, cancel)
    again = False
    try:
        existing = store.get(p.name)
        again = str(repo_cache_dir(p.repo)) in os.path.realpath(existing.path) or existing.source == "hf-cache"
    except Exception:  # noqa: BLE001 - no such model, or a broken entry: nothing to replace
        pass
    mmproj = _projector_of(p, tell)
    store.add(p.model_path, name=p.name, source="hub", replace=again, extra={"mmproj": mmproj} if mmproj else None)
    return PullResult(store.get(p.name), p, fetched, False, tuple(notices))


def _projector_of(p: PullPlan, tell: NoticeFn) -> str | None:
    """The pulled projector's path for the store entry, once its header says it is one."""
    from localrun.gguf_header import read_gguf

    path = p.projector_path
    if path is None:
        return None
    try:
        architecture = read_gguf(path, whole_model=False).architecture
    except Exception as e:  # noqa: BLE001 - a bad projector leaves a text model, said once
        architecture = f"unreadable ({getattr(e, 'message', e)})"
    if architecture != "clip":
        tell(f"'{p.projector.path if p.projector else path.name}' of '{p.repo}' is not a vision projector"
             f" (architecture {architecture}); the model is installed without it and reads no images")
        return None
    return str(path)


def _warn_fit(p: PullPlan, context: int | None, tell: NoticeFn) -> None:
    """Warn before a download that will not fit; access errors stop the pull here, before any byte."""
    try:
        est = estimate_fit(p, context)
    except _Unreachable as e:
        tell(f"could not estimate the memory '{p.repo}' needs: {e.message}")
        return
    except HubError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable header never blocks a pull
        tell(f"could not estimate the memory '{p.repo}' needs: {e}")
        return
    if est.verdict == "none":
        tell(f"'{p.repo}' needs about {human_size(est.total_bytes)} at {est.context} tokens of context"
             f" and {est.verdict_text}; it may not run here")


def human_size(n: int | None) -> str:
    """1234567 -> '1.2 MB' (decimal units, as the Hub shows them)."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if size < 1000 or unit == "PB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"
