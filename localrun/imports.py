"""Models other tools downloaded, registered in place: Ollama's store, LM Studio's models folder and
GGUF files in the Hugging Face cache. Nothing is copied; a file the other tool deletes later shows
as missing in `list`.

An Ollama model becomes two entries: its GGUF blob, registered as `ollama/NAME` (source "ollama"),
and a preset `NAME` FROM it that holds Ollama's settings for it (template, system prompt,
parameters, starting messages, licence, adapters), so `run NAME` runs it as Ollama does and
`show NAME --modelfile` prints those settings. A vision projector is recorded with the model entry
("mmproj"). Every imported model entry records where it came from ("imported"), which makes a
second import update the same names instead of adding new ones.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import BadModelFileError, LocalrunError, UsageError
from localrun.gguf_header import read_gguf
from localrun.presets import (
    PARAMETERS,
    ROLES,
    UNSUPPORTED,
    Preset,
    parse_parameter,
    preset_from_fields,
    translate_template,
)
from localrun.store import (
    _NAME_RE,
    _SPLIT_RE,
    Store,
    hf_cache_dir,
    hf_cache_ggufs,
    name_from_filename,
)

SOURCES = ("ollama", "lmstudio", "hf")
TITLES = {"ollama": "Ollama", "lmstudio": "LM Studio", "hf": "the Hugging Face cache"}
# Registry sources of the entries each import writes (an HF cache file keeps the source it is listed under).
ENTRY_SOURCES = {"ollama": "ollama", "lmstudio": "lmstudio", "hf": "hf-cache"}

_LAYER = "application/vnd.ollama.image."
_DIGEST_RE = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_TEXT_LIMIT = 16 << 20  # a template, system prompt, licence or parameter blob larger than this is not one
# Ollama's layer kinds that carry nothing localrun runs (embed: deprecated; prompt: the old name of
# template, read as one).
_IGNORED_LAYERS = {"embed"}


@dataclass(frozen=True)
class Imported:
    """A model registered (or, in a dry run, to be registered) from another tool's store."""

    name: str  # the localrun name to run it by
    path: str  # the model file (or folder), in place
    origin: str  # the other tool's name for it
    status: str  # "added", "updated" or "unchanged"
    base: str | None = None  # Ollama: the model entry the preset NAME is FROM
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"notes": list(self.notes)}


@dataclass(frozen=True)
class Skipped:
    """A model of the other tool's store that was not registered, and why."""

    origin: str
    reason: str
    path: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ImportResult:
    """What an import registered, skipped, and found gone since an earlier import."""

    source: str  # "ollama", "lmstudio" or "hf"
    root: str  # the folder read
    dry_run: bool
    imported: tuple[Imported, ...] = ()
    skipped: tuple[Skipped, ...] = ()
    missing: tuple[str, ...] = ()  # names imported earlier whose file is gone or that the tool no longer lists

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "root": self.root, "dry_run": self.dry_run,
                "imported": [i.to_dict() for i in self.imported], "skipped": [s.to_dict() for s in self.skipped],
                "missing": list(self.missing)}


def import_models(source: str, path: str | os.PathLike[str] | None = None, dry_run: bool = False,
                  store: Store | None = None) -> ImportResult:
    """Register every model of another tool's store (source: ollama, lmstudio or hf) in place."""
    importers = {"ollama": import_ollama, "lmstudio": import_lmstudio, "hf": import_hf}
    if source not in importers:
        raise UsageError(f"unknown model source '{source}'", f"choose one of {', '.join(SOURCES)}")
    return importers[source](Path(path).expanduser() if path else None, store or Store(), dry_run)


# -- where the other tools keep their models --------------------------------------------------------

def ollama_models_dir() -> Path:
    """Ollama's models folder: $OLLAMA_MODELS, else ~/.ollama/models (on Linux, the service user's
    /usr/share/ollama/.ollama/models when that is the one that exists)."""
    env = os.environ.get("OLLAMA_MODELS")
    if env:
        return Path(env).expanduser()
    default = Path.home() / ".ollama" / "models"
    service = Path("/usr/share/ollama/.ollama/models")  # the install script's system service
    if not default.is_dir() and sys.platform.startswith("linux") and service.is_dir():
        return service
    return default


def lmstudio_models_dir() -> Path:
    """LM Studio's models folder: the one its settings name, else ~/.lmstudio/models, else the
    older ~/.cache/lm-studio/models."""
    home = Path.home() / ".lmstudio"
    try:  # LM Studio's home may be moved; this file in the user's home then holds its path
        pointed = (Path.home() / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip()
        if pointed:
            home = Path(pointed).expanduser()
    except OSError:
        pass
    candidates = []
    try:
        folder = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
        if isinstance(folder, str) and folder:
            candidates.append(Path(folder).expanduser())
    except (OSError, ValueError, AttributeError):
        pass
    candidates += [home / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    return next((c for c in candidates if c.is_dir()), candidates[-2])


def _root(source: str, given: Path | None, default: Path, hint: str) -> Path:
    root = given or default
    if not root.is_dir():
        raise UsageError(f"no {TITLES[source]} models folder at '{root}'", hint)
    return root.resolve()


# -- Ollama -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _OllamaModel:
    """One Ollama manifest read and checked: what to register."""

    origin: str  # host/namespace/model:tag
    name: str
    base: str
    blob: Path
    preset: Preset
    extra: dict[str, Any]
    notes: tuple[str, ...]


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """The localrun name of an Ollama model, as Ollama shows it shortest: `llama3:latest`,
    `user/model:tag`, `hf.co/org/repo:tag` (lower-case; characters a name cannot hold become '-')."""
    if host.lower() == "registry.ollama.ai":
        family = model if namespace.lower() == "library" else f"{namespace}/{model}"
    else:
        family = f"{host}/{namespace}/{model}"
    family = re.sub(r"[^a-z0-9._\-/]+", "-", family.lower()).strip("-._/")
    tag = re.sub(r"[^a-z0-9._\-]+", "-", tag.lower()).strip("-._")
    return f"{family}:{tag or 'latest'}"


def import_ollama(root: Path | None, store: Store, dry_run: bool = False) -> ImportResult:
    """Register each model of an Ollama store: its GGUF blob as `ollama/NAME`, its settings as the
    preset NAME."""
    root = _root("ollama", root, ollama_models_dir(),
                 "pass the folder that holds Ollama's manifests/ and blobs/ with --path, or set OLLAMA_MODELS")
    imported: list[Imported] = []
    skipped: list[Skipped] = []
    seen: dict[str, str] = {}  # localrun name -> origin, in this import
    origins: set[str] = set()
    for origin, manifest in _ollama_manifests(root):
        origins.add(origin)
        try:
            plan = _read_ollama_model(root, origin, manifest)
        except LocalrunError as e:
            skipped.append(Skipped(origin, e.message, str(manifest)))
            continue
        clash = next((seen[n] for n in (plan.name, plan.base) if n in seen), None)
        if clash:
            skipped.append(Skipped(origin, f"its name '{plan.name}' is taken by {clash} in this import", str(plan.blob)))
            continue
        seen[plan.name] = seen[plan.base] = origin
        outcome = _register_ollama(store, plan, dry_run)
        if isinstance(outcome, Imported):
            imported.append(outcome)
        else:
            skipped.append(outcome)
    return ImportResult("ollama", str(root), dry_run, tuple(imported), tuple(skipped),
                        _missing(store, "ollama", root, origins))


def _ollama_manifests(root: Path) -> Iterator[tuple[str, Path]]:
    """(host/namespace/model:tag, manifest file) for each model: manifests/HOST/NAMESPACE/MODEL/TAG."""
    base = root / "manifests"
    for p in sorted(base.glob("*/*/*/*")):
        if p.is_file() and not p.name.startswith("."):
            host, namespace, model, tag = p.relative_to(base).parts
            yield f"{host}/{namespace}/{model}:{tag}", p


def _read_ollama_model(root: Path, origin: str, manifest: Path) -> _OllamaModel:
    """The model file, settings and notes of one manifest; LocalrunError says why it cannot be used."""
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        layers = [(str(x["mediaType"]), str(x["digest"]), int(x.get("size", -1))) for x in data["layers"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadModelFileError(f"its manifest '{manifest}' cannot be read ({e})") from e
    config = _ollama_config(root, data.get("config"))
    kinds: dict[str, list[Path]] = {}
    for media, digest, size in layers:
        if not media.startswith(_LAYER):
            continue
        kinds.setdefault(media[len(_LAYER):], []).append(_blob(root, digest, size))
    models = kinds.get("model", [])
    if not models:
        if config.get("remote_host"):
            raise UsageError(f"it is a cloud model (run on {config['remote_host']}); it has no weights on disk")
        if kinds.get("tensor"):
            raise UsageError("its weights are stored as separate tensors (Ollama's own engine), not as a GGUF file")
        raise UsageError("its manifest has no model layer")
    blob = models[0]
    if config.get("model_format") not in (None, "", "gguf"):
        raise UsageError(f"its model is in {config['model_format']} format, not GGUF")
    meta = read_gguf(blob)  # a broken or truncated blob is reported here, not at run time
    host, namespace, rest = origin.split("/", 2)
    model, tag = rest.rsplit(":", 1)
    name = ollama_name(host, namespace, model, tag)
    base = f"ollama/{name}"
    if not _NAME_RE.match(name) or not _NAME_RE.match(base):
        raise UsageError(f"its name cannot be written as a localrun name (got '{name}')")
    notes: list[str] = []
    preset = _ollama_preset(base, kinds, notes, own_template=bool(meta.chat_template))
    if config.get("renderer") or config.get("parser"):
        own = "its TEMPLATE" if preset.template else "the GGUF's own chat template"
        notes.append(f"Ollama formats its chats with built-in code ({config.get('renderer') or config.get('parser')}); "
                     f"localrun uses {own}")
    extra: dict[str, Any] = {"imported": {"from": "ollama", "origin": origin, "root": str(root)}}
    projectors = kinds.get("projector", [])
    if projectors:
        extra["mmproj"] = str(projectors[0])
        notes.append("its vision projector is recorded with the model (mmproj); images are not read yet")
    for kind in sorted(set(kinds) - {"model", "projector", "adapter", "template", "prompt", "system", "params",
                                     "messages", "license", *_IGNORED_LAYERS}):
        notes.append(f"its {kind} layer is not used")
    return _OllamaModel(origin, name, base, blob, preset, extra, tuple(notes))


def _blob(root: Path, digest: str, size: int) -> Path:
    """The blob file of a layer, checked to exist with the manifest's size."""
    m = _DIGEST_RE.match(digest.lower())
    if not m:
        raise BadModelFileError(f"a layer has the digest '{digest}', not sha256:<hex>")
    path = root / "blobs" / f"sha256-{m.group(1)}"
    try:
        actual = path.stat().st_size
    except OSError as e:
        raise BadModelFileError(f"its blob '{path}' is missing ({e.strerror})",
                                "pull it again with Ollama, then import again") from e
    if size >= 0 and actual != size:
        raise BadModelFileError(f"its blob '{path}' holds {actual} bytes and the manifest says {size}",
                                "pull it again with Ollama, then import again")
    return path


def _ollama_config(root: Path, layer: Any) -> dict[str, Any]:
    """The manifest's config blob (model_format, renderer, remote_host, ...); {} when absent or unreadable."""
    try:
        path = _blob(root, str(layer["digest"]), int(layer.get("size", -1)))
        config = json.loads(path.read_text(encoding="utf-8"))
    except (LocalrunError, OSError, ValueError, KeyError, TypeError):
        return {}
    return config if isinstance(config, dict) else {}


def _text(path: Path) -> str:
    if path.stat().st_size > _TEXT_LIMIT:
        raise BadModelFileError(f"the blob '{path}' is too large for a text layer")
    return path.read_text(encoding="utf-8", errors="replace")


def _ollama_preset(base: str, kinds: dict[str, list[Path]], notes: list[str], own_template: bool) -> Preset:
    """The preset holding an Ollama model's settings; what localrun cannot use is left out with a note."""
    params: dict[str, Any] = {}
    for path in kinds.get("params", []):
        try:
            raw = json.loads(_text(path))
        except ValueError as e:
            raise BadModelFileError(f"its parameters blob '{path}' is not JSON ({e})") from e
        for key, value in (raw.items() if isinstance(raw, dict) else ()):
            if key.lower() not in PARAMETERS:
                why = "not supported by localrun" if key.lower() in UNSUPPORTED else "unknown to localrun"
                notes.append(f"parameter {key} {json.dumps(value)} is left out ({why})")
                continue
            try:
                for v in value if isinstance(value, list) else [value]:
                    parse_parameter(key, str(v).lower() if isinstance(v, bool) else str(v))
            except UsageError as e:
                notes.append(f"parameter {key} is left out ({e.message})")
                continue
            params[key.lower()] = value
    messages = []
    for path in kinds.get("messages", []):
        try:
            raw_messages = json.loads(_text(path))
        except ValueError as e:
            raise BadModelFileError(f"its messages blob '{path}' is not JSON ({e})") from e
        for m in raw_messages if isinstance(raw_messages, list) else ():
            if isinstance(m, dict) and m.get("role") in ROLES:
                messages.append({"role": str(m["role"]), "content": str(m.get("content") or "")})
            else:
                role = m.get("role") if isinstance(m, dict) else None
                notes.append(f"a starting message with role {role!r} is left out (roles are {', '.join(ROLES)})")
    system = next((_text(p) for p in kinds.get("system", [])), None)
    licenses = [_text(p) for p in kinds.get("license", [])]
    adapters = []
    for path in kinds.get("adapter", []):
        if read_gguf(path, whole_model=False).metadata.get("general.type") != "adapter":
            raise UsageError(f"its adapter '{path}' is not a GGUF LoRA adapter")
        adapters.append(str(path))
    preset = preset_from_fields(base, system=system, parameters=params, messages=messages, license=licenses,
                                adapters=adapters)
    template_blob = next(iter(kinds.get("template", []) + kinds.get("prompt", [])), None)
    if template_blob is not None:
        text = _text(template_blob)
        try:
            jinja, go = translate_template(text, None)
        except UsageError as e:
            instead = "the GGUF's own chat template is" if own_template else "and the GGUF has no chat template"
            notes.append(f"its TEMPLATE is not used, {instead} ({e.message})")
        else:
            preset = dataclasses.replace(preset, template=jinja, template_source=go)
    return preset


def _register_ollama(store: Store, plan: _OllamaModel, dry_run: bool) -> Imported | Skipped:
    """Register the blob as plan.base and the preset plan.name FROM it (each only when changed)."""
    models = store.registered()
    base_entry, preset_entry = models.get(plan.base), models.get(plan.name)
    if base_entry is not None and (base_entry.get("imported") or {}).get("from") != "ollama":
        return Skipped(plan.origin, f"the name '{plan.base}' is taken by a model not imported from Ollama",
                       str(plan.blob))
    if preset_entry is not None and not (preset_entry.get("kind") == "preset"
                                         and (preset_entry.get("preset") or {}).get("base") == plan.base):
        return Skipped(plan.origin, f"the name '{plan.name}' is taken by another model "
                                    f"({preset_entry.get('path')}); rename it ('localrun cp', 'localrun rm') "
                                    "and import again", str(plan.blob))
    preset_dict = json.loads(json.dumps(plan.preset.to_dict()))
    base_same = base_entry is not None and _same_entry(base_entry, str(plan.blob), plan.extra)
    preset_same = preset_entry is not None and preset_entry.get("preset") == preset_dict
    status = "unchanged" if base_same and preset_same else "added" if base_entry is None else "updated"
    if not dry_run:
        try:
            if not base_same:
                store.add(plan.blob, name=plan.base, source="ollama", replace=True, extra=plan.extra)
            if not preset_same:
                store.add_preset(plan.name, plan.preset, replace=True)
        except LocalrunError as e:
            return Skipped(plan.origin, e.message, str(plan.blob))
    return Imported(plan.name, str(plan.blob), plan.origin, status, plan.base, plan.notes)


def _same_entry(entry: dict[str, Any], path: str, extra: dict[str, Any]) -> bool:
    return entry.get("path") == path and all(entry.get(k) == v for k, v in extra.items()) \
        and ("mmproj" in extra or "mmproj" not in entry)


# -- LM Studio and the Hugging Face cache: plain model files ------------------------------------------

@dataclass(frozen=True)
class _File:
    """A model file (or MLX folder) found in another tool's folder."""

    name: str  # the name wanted
    path: Path
    origin: str
    mmproj: str | None = None
    notes: tuple[str, ...] = field(default=())


def import_lmstudio(root: Path | None, store: Store, dry_run: bool = False) -> ImportResult:
    """Register each model of LM Studio's models folder (PUBLISHER/REPO/FILE.gguf, or an MLX folder
    PUBLISHER/REPO) under `publisher/repo:quantization`."""
    root = _root("lmstudio", root, lmstudio_models_dir(),
                 "pass LM Studio's models folder with --path (LM Studio shows it under My Models)")
    return _import_files("lmstudio", root, list(_lmstudio_files(root)), store, dry_run)


def _lmstudio_files(root: Path) -> Iterator[_File]:
    for repo in sorted(p for p in root.glob("*/*") if p.is_dir() and not p.parent.name.startswith(".")):
        where = f"{repo.parent.name}/{repo.name}"
        family = _family(where)
        ggufs = sorted(repo.glob("*.gguf"))
        if not ggufs and (repo / "config.json").is_file():  # an MLX (or Hugging Face) model folder
            yield _File(f"{family}:latest", repo, where)
        yield from _gguf_files(ggufs, family, functools.partial(_in_folder, where))


def _in_folder(folder: str, path: Path) -> str:
    return f"{folder}/{path.name}"


def _family(text: str) -> str:
    """A name's family from a publisher/repo path: lower-case, '-gguf' dropped, other characters '-'."""
    parts = [re.sub(r"[^a-z0-9._\-]+", "-", part.lower()).strip("-._") for part in text.split("/")]
    return re.sub(r"-gguf$", "", "/".join(p for p in parts if p)) or "model"


def _gguf_files(files: Sequence[Path], family: str, origin: Callable[[Path], str]) -> Iterator[_File]:
    """The models among one folder's GGUF files (first shard of a split; a projector goes to the models
    beside it), named `family:quantization`, or `family:file-stem` where two share a quantization."""
    projectors = [f for f in files if "mmproj" in f.name.lower()]
    models = [f for f in files if f not in projectors and not _later_shard(f)]
    tags = [name_from_filename(f).split(":", 1)[1] for f in models]
    mmproj = str(projectors[0]) if projectors else None
    notes = ("its vision projector is recorded with the model (mmproj); images are not read yet",) if mmproj else ()
    for f, tag in zip(models, tags, strict=True):
        if tags.count(tag) > 1:
            stem = _SPLIT_RE.sub(".gguf", f.name).removesuffix(".gguf")
            tag = re.sub(r"[^a-z0-9._\-]+", "-", stem.lower()).strip("-._") or tag
        yield _File(f"{family}:{tag}", f, origin(f), mmproj, notes)


def _later_shard(path: Path) -> bool:
    m = _SPLIT_RE.search(path.name)
    return bool(m and m.group(1) != "00001")


def import_hf(root: Path | None, store: Store, dry_run: bool = False) -> ImportResult:
    """Register each GGUF file of the Hugging Face cache under the name `list` shows it by."""
    root = _root("hf", root, hf_cache_dir(), "pass the hub cache folder with --path, or set HF_HUB_CACHE")
    found: dict[Path, list[tuple[str, Path]]] = {}
    for name, path, _ in hf_cache_ggufs(root):
        found.setdefault(Path(path).parent, []).append((name, Path(path)))
    files: list[_File] = []
    for entries in found.values():  # the names `list` shows: the repo's name, the file's quantization
        files += _gguf_files([p for _, p in entries], entries[0][0].split(":", 1)[0], _hf_origin)
    return _import_files("hf", root, files, store, dry_run)


def _hf_origin(path: Path) -> str:
    """`org/repo/file` of a file in the hub cache (models--org--repo/snapshots/REV/file)."""
    parts = path.parts
    if "snapshots" in parts:
        i = parts.index("snapshots")
        repo = parts[i - 1].removeprefix("models--").replace("--", "/")
        return "/".join([repo, *parts[i + 2:]])
    return str(path)


def _import_files(source: str, root: Path, files: list[_File], store: Store, dry_run: bool) -> ImportResult:
    imported: list[Imported] = []
    skipped: list[Skipped] = []
    taken: set[str] = set()
    for f in files:
        try:
            if f.path.is_file():
                meta = read_gguf(f.path)
                if meta.architecture == "clip" or meta.metadata.get("general.type") in ("mmproj", "adapter"):
                    skipped.append(Skipped(f.origin, f"it is a {meta.metadata.get('general.type') or 'projector'}, "
                                                     "not a model", str(f.path)))
                    continue
        except LocalrunError as e:
            skipped.append(Skipped(f.origin, e.message, str(f.path)))
            continue
        outcome = _register_file(store, source, root, f, taken, dry_run)
        if isinstance(outcome, Imported):
            imported.append(outcome)
        else:
            skipped.append(outcome)
    return ImportResult(source, str(root), dry_run, tuple(imported), tuple(skipped),
                        _missing(store, source, root, {f.origin for f in files}))


def _register_file(store: Store, source: str, root: Path, f: _File, taken: set[str], dry_run: bool
                   ) -> Imported | Skipped:
    """Register one file under a stable name: the name an earlier import gave it, else the wanted
    name, else the wanted name with -2, -3, ... after its family."""
    models = store.registered()
    extra: dict[str, Any] = {"imported": {"from": source, "origin": f.origin, "root": str(root)}}
    if f.mmproj:
        extra["mmproj"] = f.mmproj
    real = os.path.realpath(f.path)
    ours = [n for n, e in models.items() if e.get("kind") != "preset" and _is_import(e, source, root, f.origin)]
    others = [n for n, e in models.items() if e.get("kind") != "preset" and os.path.realpath(e["path"]) == real
              and n not in ours]
    if others and not ours:
        return Skipped(f.origin, f"it is registered already, as '{others[0]}'", str(f.path))
    if ours:
        name = ours[0]
    else:
        name, family, tag, i = f.name, f.name.split(":", 1)[0], f.name.split(":", 1)[1], 1
        while name in models or name in taken:
            i += 1
            name = f"{family}-{i}:{tag}"
    if not _NAME_RE.match(name):
        return Skipped(f.origin, f"its name cannot be written as a localrun name (got '{name}')", str(f.path))
    taken.add(name)
    entry = models.get(name)
    status = "added" if entry is None else "unchanged" if _same_entry(entry, str(f.path), extra) else "updated"
    if not dry_run and status != "unchanged":
        try:
            store.add(f.path, name=name, source=ENTRY_SOURCES[source], replace=True, extra=extra)
        except LocalrunError as e:
            return Skipped(f.origin, e.message, str(f.path))
    return Imported(name, str(f.path), f.origin, status, None, f.notes)


def _is_import(entry: dict[str, Any], source: str, root: Path, origin: str | None = None) -> bool:
    mark = entry.get("imported") or {}
    return mark.get("from") == source and mark.get("root") == str(root) and (origin is None or mark.get("origin") == origin)


def _missing(store: Store, source: str, root: Path, origins: set[str]) -> tuple[str, ...]:
    """Names imported earlier from this folder whose file is gone or that it no longer holds, with
    the presets FROM them."""
    models = store.registered()
    gone = {n for n, e in models.items() if _is_import(e, source, root)
            and (not os.path.exists(e["path"]) or (e.get("imported") or {}).get("origin") not in origins)}
    presets = {n for n, e in models.items() if e.get("kind") == "preset" and (e.get("preset") or {}).get("base") in gone}
    return tuple(sorted(gone | presets))
