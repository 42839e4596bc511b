"""LoRA adapters in the store: names to files, an adapter's base model, where each engine applies them.

An adapter is registered like a model (a GGUF LoRA file, `kind = adapter`) with a link to its base
model and the PEFT folder it came from. Front ends name adapters as `--lora NAME[:SCALE]`, as a
model name of its own (`localrun run my-adapter`: its base, with it applied), or as an Ollama-style
`base+adapter[:scale]` model name. llama.cpp applies GGUF adapters per request on a base model that
stays loaded; MLX applies the PEFT folder when the model loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from localrun.backends.base import abilities, engines_with
from localrun.chat import Message
from localrun.errors import ConversionError, ModelNotFoundError, UsageError
from localrun.generation import Request
from localrun.presets import Preset
from localrun.settings import LoadOptions
from localrun.store import ModelInfo, Store, hf_cache_dir, normalize_name

_SCALE_RE = re.compile(r"^(?P<name>.+):(?P<scale>[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)$", re.IGNORECASE)


def parse_spec(spec: str) -> tuple[str, float]:
    """`NAME[:SCALE]` -> (NAME, SCALE); a tag that is not a number stays part of the name."""
    spec = spec.strip()
    if not spec:
        raise UsageError("an empty --lora value", "give an adapter name or file, e.g. --lora my-adapter:0.8")
    m = _SCALE_RE.match(spec)
    if m and not Path(spec).exists():
        return m.group("name"), float(m.group("scale"))
    return spec, 1.0


@dataclass(frozen=True)
class Target:
    """What to run: a base model, the adapters applied to it (with their scales), and the settings of
    the preset it was named by (if any)."""

    model: ModelInfo
    adapters: tuple[tuple[ModelInfo, float], ...] = ()
    preset: Preset | None = None  # the merged settings of a preset's chain
    preset_name: str | None = None
    draft: ModelInfo | None = None  # the draft model the preset names (`PARAMETER draft MODEL`)

    @property
    def name(self) -> str:
        """The name a reply is reported under (`base+adapter`, as given adapters are applied; a
        preset's own name)."""
        if self.preset_name:
            own = {a for a in self.preset.adapters} if self.preset else set()
            extra = [a for a in self.adapters if a[0].path not in own and a[0].name not in own]
            return "+".join([self.preset_name, *(a.name if s == 1.0 else f"{a.name}:{s:g}" for a, s in extra)])
        return "+".join([self.model.name, *(a.name if s == 1.0 else f"{a.name}:{s:g}" for a, s in self.adapters)])

    def request(self, request: Request) -> Request:
        """The request with the preset's template, its system prompt (when the conversation has none)
        and its starting conversation (before the request's messages, after its system prompt)."""
        p = self.preset
        if p is None or request.prompt is not None:
            return request
        messages = list(request.messages)
        head = [m for m in messages[:1] if m.role == "system"]
        rest = messages[len(head):]
        if not head and p.system:
            head = [Message("system", p.system)]
        start = [Message(m["role"], m["content"]) for m in p.messages]
        out = replace(request, messages=tuple(head + start + rest))
        return replace(out, template=p.template) if p.template and not request.template else out

    def load_options(self, options: LoadOptions, engine: str) -> LoadOptions:
        """The load options for this engine: the preset's where the options keep their defaults; one
        that applies adapters when it loads gets their PEFT folders."""
        if self.preset:
            default = LoadOptions()
            given = {k: v for k, v in self.preset.load_values().items()
                     if hasattr(options, k) and getattr(options, k) == getattr(default, k)}
            if self.draft is not None and options.draft is None:
                given["draft"] = self.draft.path
            if given:
                options = replace(options, **given)
        if abilities(engine).request_adapters or not self.adapters:
            return options
        return replace(options, lora=tuple((peft_folder(a, engine), s) for a, s in self.adapters))


def peft_folder(adapter: ModelInfo, engine: str) -> str:
    """The PEFT folder an adapter was converted from (what an engine that applies adapters on load reads)."""
    if adapter.format == "peft":
        return adapter.path
    folder = (adapter.details.get("adapter") or {}).get("peft")
    if not folder or not Path(folder, "adapter_config.json").is_file():
        others = engines_with("request_adapters")
        raise UsageError(
            f"the {engine} engine needs the PEFT folder of adapter '{adapter.name}', and it is not known or gone",
            "pass the PEFT folder itself: --lora PATH/TO/ADAPTER_DIR"
            + "".join(f", or run it on {n} (--engine {n})" for n in others[:1]))
    return str(folder)


def _peft_info(folder: Path) -> ModelInfo:
    """A PEFT adapter folder given by path (MLX runs it as it is)."""
    cfg = _read_config(folder)
    return ModelInfo(folder.name, str(folder), "peft", "path", 0, architecture=None, kind="adapter",
                     details={"adapter": {"peft": str(folder), "base_model": cfg.get("base_model_name_or_path")}})


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((folder / "adapter_config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read {folder / 'adapter_config.json'}: {e}", "pass a PEFT adapter folder") from e


def find_adapter(store: Store, spec: str) -> ModelInfo:
    """An adapter by store name, GGUF file or PEFT folder; anything else is a clear error."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "adapter_config.json").is_file():
        return _peft_info(path.resolve())
    return store.get(spec)


def resolve(store: Store, name: str, lora: Sequence[str] = ()) -> Target:
    """The base model and adapters meant by a model name and --lora values.

    `name` may be a model, an adapter (its registered base runs with it), or `base+adapter[:scale]+...`.
    """
    parts = name.split("+")
    if len(parts) > 1 and all(parts) and not Path(name).exists():
        base_name, extra = parts[0], parts[1:]
    else:
        base_name, extra = name, []
    refs: list[tuple[ModelInfo, float]] = []
    for spec in [*extra, *lora]:
        adapter_name, scale = parse_spec(spec)
        refs.append((find_adapter(store, adapter_name), scale))
    return make_target(store, store.get(base_name), refs)


def preset_chain(store: Store, info: ModelInfo) -> tuple[ModelInfo, Preset | None]:
    """The model a preset's FROM chain ends at, and the chain's settings merged (the nearest wins)."""
    chain: list[Preset] = []
    names = [info.name]
    while info.is_preset:
        chain.append(Preset.from_dict(info.details["preset"]))
        info = store.get(chain[-1].base)
        if info.name in names or len(names) > 16:
            raise UsageError(f"preset '{names[0]}' has a FROM chain that loops ({' -> '.join([*names, info.name])})",
                             "re-create one of them FROM a model")
        names.append(info.name)
    merged: Preset | None = None
    for p in reversed(chain):
        merged = p.over(merged)
    return info, merged


def make_target(store: Store, info: ModelInfo, refs: Sequence[tuple[ModelInfo, float]]) -> Target:
    """A Target from a model (or an adapter, standing for its base with it; or a preset, standing for
    its base with its settings and adapters) and adapters, checked."""
    adapters: list[tuple[ModelInfo, float]] = []
    preset_name = info.name if info.is_preset else None
    info, preset = preset_chain(store, info)
    if preset:
        refs = [*((find_adapter(store, a), 1.0) for a in preset.adapters), *refs]
    if info.is_adapter:
        adapters.append((info, 1.0))
        info = base_of(store, info)
    for adapter, scale in refs:
        if not adapter.is_adapter:
            raise UsageError(f"'{adapter.name}' is a model, not a LoRA adapter",
                             "give an adapter made by 'localrun convert ADAPTER_DIR' (see 'localrun list')")
        adapters.append((adapter, scale))
    for adapter, _ in adapters:
        if adapter.architecture and info.architecture and adapter.architecture != info.architecture \
                and info.format == "gguf":
            raise UsageError(
                f"adapter '{adapter.name}' is for {adapter.architecture} models and '{info.name}' is {info.architecture}",
                f"run it on its base model{f' ({adapter.base})' if adapter.base else ''}")
        if adapter.format == "peft" and info.format == "gguf":
            raise UsageError(
                f"'{adapter.path}' is a PEFT folder; llama.cpp runs GGUF adapters",
                f"convert it first: localrun convert {adapter.path}")
    draft = store.get(preset.draft_model) if preset and preset.draft_model else None
    return Target(info, tuple(adapters), preset, preset_name, draft)


def base_of(store: Store, adapter: ModelInfo) -> ModelInfo:
    """The registered base model of an adapter: its link, else a GGUF converted (later) from the
    checkpoint folder it was converted against."""
    base_path = (adapter.details.get("adapter") or {}).get("base_path")
    if not adapter.base and base_path and Path(base_path).is_dir():
        converted = store.converted_from(base_path)
        if converted:
            return store.get(converted[0])
        raise ModelNotFoundError(
            f"adapter '{adapter.name}' has no base model in the store (its base {base_path} is not converted)",
            f"convert the base: localrun convert {base_path}, or name one: localrun run BASE --lora {adapter.name}")
    if not adapter.base:
        raise ModelNotFoundError(
            f"adapter '{adapter.name}' has no base model in the store",
            f"name the base: localrun run BASE --lora {adapter.name}, or convert the base checkpoint "
            "('localrun convert BASE_DIR') and the adapter again")
    try:
        return store.get(adapter.base)
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"the base model '{adapter.base}' of adapter '{adapter.name}' is not installed",
                                 f"install it again, or name another base: localrun run BASE --lora {adapter.name}") from e


# -- conversion: a PEFT folder to a registered GGUF adapter ---------------------------------------
@dataclass(frozen=True)
class Base:
    """Where an adapter's base was found: the file or folder the converter checks shapes against,
    and the store model it runs on (if there is one)."""

    path: str
    name: str | None
    how: str


def find_base(store: Store, adapter_dir: Path, base: str | None) -> Base:
    """The base model of a PEFT adapter: --base, else its base_model_name_or_path, looked up in the
    store, as a local folder and in the Hugging Face cache."""
    wanted = base or _read_config(adapter_dir).get("base_model_name_or_path")
    if not wanted:
        raise UsageError(f"{adapter_dir / 'adapter_config.json'} names no base model (base_model_name_or_path)",
                         "pass the base with --base (a model name, a GGUF file or a Hugging Face folder)")
    found = _lookup(store, str(wanted))
    if found is None:
        raise ModelNotFoundError(
            f"the adapter's base model '{wanted}' is not here (not in the store, not a folder, not in the "
            "Hugging Face cache)",
            f"download it (e.g. 'huggingface-cli download {wanted}') or pass it with --base PATH" if not base
            else "pass a model name from 'localrun list', a GGUF file or a Hugging Face model folder")
    return found


def _lookup(store: Store, wanted: str) -> Base | None:
    path = Path(wanted).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return _hf_folder(store, path.resolve(), "folder")
    if path.is_file() and path.suffix == ".gguf":
        name = next((m.name for m in store.list() if os.path.realpath(m.path) == os.path.realpath(path)), None)
        return Base(str(path.resolve()), name, "file")
    try:
        info = store.get(wanted)
    except (ModelNotFoundError, UsageError):
        info = None
    except Exception:  # noqa: BLE001 - a broken registration is not this adapter's base
        info = None
    if info is not None and not info.is_adapter:
        if info.format == "gguf":
            return Base(info.path, info.name, "store")
        return _hf_folder(store, Path(info.path), "store")
    snapshot = _hf_snapshot(wanted)
    if snapshot is not None:
        return _hf_folder(store, snapshot, "Hugging Face cache")
    return None


def _hf_folder(store: Store, folder: Path, how: str) -> Base:
    converted = store.converted_from(folder)
    return Base(str(folder), converted[0] if converted else None, how)


def _hf_snapshot(repo: str) -> Path | None:
    """The newest snapshot of a repo in the Hugging Face cache that has a config.json."""
    if repo.count("/") != 1:
        return None
    snaps = hf_cache_dir() / f"models--{repo.replace('/', '--')}" / "snapshots"
    if not snaps.is_dir():
        return None
    found = [p for p in snaps.iterdir() if (p / "config.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime).resolve() if found else None


def default_name(adapter_dir: Path) -> str:
    family = re.sub(r"[^a-z0-9._\-]+", "-", adapter_dir.resolve().name.lower()).strip("-._") or "adapter"
    return f"{family}:lora"


def convert_and_register(store: Store, adapter_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None,
                         *, base: str | None, outtype: str, name: str | None, force: bool, dry_run: bool,
                         register: bool) -> tuple[Any, ModelInfo | None, Base]:
    """Convert a PEFT folder to a GGUF adapter and register it linked to its base."""
    import convert

    folder = Path(adapter_dir).expanduser()
    found = find_base(store, folder, base)
    new_name = normalize_name(name) if name else default_name(folder)
    if register and not dry_run:
        _check_name_free(store, new_name, force)
    try:
        result = convert.convert_adapter(folder, found.path, out, outtype=outtype, name=new_name, force=force,
                                         dry_run=dry_run)
    except convert.ConvertError as e:
        raise ConversionError(e.message, e.hint) from e
    if dry_run or not register:
        return result, None, found
    extra = {"kind": "adapter", "base": found.name,
             "adapter": {"peft": str(folder.resolve()), "base_model": result.base_model, "base_path": found.path,
                         "rank": result.rank, "alpha": result.alpha, "targets": list(result.targets)}}
    info = store.add(result.path, name=new_name, replace=force, extra=extra)
    return result, info, found


def _check_name_free(store: Store, name: str, force: bool) -> None:
    """Fail before the work when the name is taken (and --force is not given)."""
    try:
        existing = store.get(name)
    except (ModelNotFoundError, UsageError):
        return
    except Exception:  # noqa: BLE001 - a broken registration under that name: replacing it is fine
        return
    if existing.source != "path" and not force:
        raise UsageError(f"a model named '{existing.name}' is already installed ({existing.path})",
                         "choose another name with --name, or pass --force to replace it")
