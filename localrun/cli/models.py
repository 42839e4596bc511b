"""`localrun list`, `show`, `rm`, `add`, `create`, `cp`: the local model store and presets."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from localrun.units import count as human_count
from localrun.units import experts as experts_text
from localrun.units import size as human_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", aliases=["ls"], help="list installed models", description=cmd_list.__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a model's metadata", description=cmd_show.__doc__)
    p.add_argument("model", help="model name or path")
    p.add_argument("--json", action="store_true", help="print a JSON object (includes the file path)")
    p.add_argument("--template", action="store_true", help="print only the chat template")
    p.add_argument("--modelfile", action="store_true",
                   help="print a Modelfile that 'localrun create' turns back into this model or preset")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("create", help="create a preset from a Modelfile", description=cmd_create.__doc__)
    p.add_argument("name", help="the preset's name, e.g. mario (tag :latest added when none is given)")
    p.add_argument("-f", "--file", default="Modelfile", metavar="MODELFILE",
                   help="the Modelfile ('-' reads stdin; default: ./Modelfile)")
    p.add_argument("--json", action="store_true", help="print the created preset as JSON")
    p.set_defaults(func=cmd_create)

    p = sub.add_parser("cp", help="copy a model or preset under another name (nothing copied on disk)",
                       description=cmd_cp.__doc__)
    p.add_argument("source", help="model or preset name")
    p.add_argument("destination", help="the new name")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("rm", help="remove a model", description=cmd_rm.__doc__)
    p.add_argument("models", nargs="+", metavar="MODEL", help="model name(s)")
    p.add_argument("--json", action="store_true", help="print what was removed as JSON")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("add", help="register an existing GGUF file, or another tool's models, in place",
                       description=cmd_add.__doc__)
    p.add_argument("path", nargs="?", help="a .gguf file (or an MLX / Hugging Face model folder)")
    p.add_argument("--name", help="short name, e.g. mymodel:q4 (default: from the file name)")
    p.add_argument("--force", action="store_true", help="replace a model of the same name")
    p.add_argument("--mmproj", metavar="FILE", help="a vision model's projector (mmproj GGUF), kept with it")
    p.add_argument("--from", dest="source", choices=("ollama", "lmstudio", "hf"),
                   help="register every model of Ollama's store, LM Studio's models folder or the Hugging Face cache")
    p.add_argument("--path", dest="folder", metavar="DIR",
                   help="with --from: the folder to read (default: where that tool keeps its models)")
    p.add_argument("--dry-run", action="store_true", help="with --from: say what would be registered, register nothing")
    p.add_argument("--json", action="store_true", help="print the registered model (with --from: the import) as JSON")
    p.set_defaults(func=cmd_add)


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def cmd_list(args: argparse.Namespace) -> int:
    """List installed models: name, format, architecture, parameters, quantization, size, context."""
    from localrun import api

    models = api.list_models()
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print("no models installed; try 'localrun pull REPO' or 'localrun add FILE.gguf'", file=sys.stderr)
        return 0
    rows = [
        [m.name, m.format, m.architecture or "-", human_count(m.parameters), m.quantization or "-",
         "-" if m.is_preset else human_size(m.size), str(m.context_length or "-"),
         ("missing: " if m.details.get("missing") else "") + m.details.get("error", "") or _adapter_note(m)
         or _vision_note(m)]
        for m in models
    ]
    print(_table(rows, ["NAME", "FORMAT", "ARCH", "PARAMS", "QUANT", "SIZE", "CONTEXT", ""]))
    return 0


def _projector(path: str | None) -> str | None:
    import os

    if not path:
        return None
    if not os.path.isfile(path):
        return f"{path} (missing: the model runs as text)"
    return f"{path} ({human_size(os.path.getsize(path))})"


def _vision_note(m: Any) -> str:
    import os

    mmproj = m.details.get("mmproj")
    if not mmproj:
        return ""
    return "vision" if os.path.isfile(mmproj) else "vision projector missing"


def _adapter_note(m: Any) -> str:
    if m.is_preset:
        return f"preset of {m.base}"
    if not m.is_adapter:
        return ""
    return f"LoRA adapter of {m.base}" if m.base else "LoRA adapter (base not in the store)"


def cmd_show(args: argparse.Namespace) -> int:
    """Show a model's architecture, parameters, quantization, context, tokenizer, licence, chat
    template and other metadata."""
    from localrun import api

    m = api.get_model(args.model)
    if args.modelfile:
        print(api.modelfile(m.name if m.source != "path" else m.path), end="")
        return 0
    preset = None
    if m.is_preset:
        from localrun.adapters import preset_chain

        _, preset = preset_chain(api.store(), m)
    if args.template:
        print((preset.template if preset and preset.template else None) or m.details.get("chat_template") or "")
        return 0
    from localrun.gguf_header import model_experts

    experts = model_experts(m.details)
    context = None if m.is_adapter else api.default_context(m, _preset_load(preset))
    if args.json:
        out = m.to_dict(with_details=True)
        if preset is not None:
            out["preset"] = preset.to_dict()
        if context is not None:
            out["context"] = context.to_dict()
        if not m.is_adapter:
            out["capabilities"] = list(api.capabilities(m))
        if experts is not None:
            out["experts"] = {"count": experts.count, "used": experts.used, "shared": experts.shared,
                              "active_parameters": experts.active_parameters, "expert_bytes": experts.expert_bytes}
        print(json.dumps(out, indent=2, ensure_ascii=False, default=str))
        return 0
    d = m.details
    params = f"{human_count(m.parameters)} ({m.parameters})" if m.parameters else None
    if params and experts is not None:
        params += f", {human_count(experts.active_parameters)} active ({experts.active_parameters})"
    rows: list[tuple[str, Any]] = [
        ("name", m.name), ("path", m.path), ("format", m.format), ("source", m.source),
        ("architecture", m.architecture), ("parameters", params),
        ("experts", experts_text(experts.count, experts.used, experts.shared) if experts else None),
        ("quantization", m.quantization), ("size", human_size(m.size)), ("context", context.text if context else m.context_length),
        ("tokenizer", f"{d.get('tokenizer')} (pre: {d.get('tokenizer_pre')}), {d.get('vocab_size')} tokens" if d.get("tokenizer") else None),
        ("license", d.get("license")),
        ("projector", _projector(d.get("mmproj"))),
        ("capabilities", None if m.is_adapter else ", ".join(api.capabilities(m))),
    ]
    if m.is_adapter:
        a = d.get("adapter") or {}
        meta_alpha = (d.get("metadata") or {}).get("adapter.lora.alpha")
        rows[1:1] = [("kind", "LoRA adapter"), ("base", m.base or "not in the store (run it with --lora on its base)"),
                     ("base model", a.get("base_model")), ("rank", a.get("rank")),
                     ("alpha", a.get("alpha", meta_alpha)), ("targets", ", ".join(a.get("targets") or []) or None),
                     ("PEFT folder", a.get("peft"))]
    else:
        adapters = [x.name for x in api.store().adapters_of(m.name)]
        if adapters:
            rows.append(("adapters", ", ".join(adapters)))
        presets = api.store().presets_of(m)
        if presets:
            rows.append(("presets", ", ".join(presets)))
    if preset is not None:
        rows[1:1] = [("kind", "preset"), ("from", m.base),
                     ("parameters", ", ".join(f"{k} {v}" for k, v in preset.parameters.items()) or None),
                     ("system", preset.system), ("adapters", ", ".join(preset.adapters) or None),
                     ("messages", f"{len(preset.messages)} starting messages" if preset.messages else None)]
    for key, value in rows:
        if value is not None:
            print(f"{key:<16}{value}")
    meta = d.get("metadata") or {}
    skip = {"tokenizer.chat_template", "general.architecture", "general.license"}
    if meta:
        print("\nmetadata")
        for key, value in meta.items():
            if key not in skip:
                print(f"  {key:<44}{value}")
    template = (preset.template if preset and preset.template else None) or d.get("chat_template")
    if template:
        print("\nchat template" + (" (the preset's)" if preset and preset.template else ""))
        print("  " + template.replace("\n", "\n  "))
    return 0


def _preset_load(preset: Any) -> Any:
    """The load options a preset sets (its num_ctx, ...), for the context `show` reports."""
    from dataclasses import replace

    from localrun.settings import LoadOptions

    options = LoadOptions()
    return replace(options, **preset.load_values()) if preset is not None and preset.load_values() else options


def cmd_create(args: argparse.Namespace) -> int:
    """Create a preset from a Modelfile (Ollama's format): FROM a model, a GGUF file, a Hugging Face
    folder (converted once) or another preset; PARAMETER, SYSTEM, TEMPLATE (Jinja, or Ollama's Go
    templates for the constructs its Modelfiles use), ADAPTER, MESSAGE, LICENSE. Nothing of the model
    is copied; running NAME runs the base with these settings, under a request's own options."""
    import os

    from localrun import api
    from localrun.errors import UsageError

    if args.file == "-":
        text, folder = sys.stdin.read(), os.getcwd()
    else:
        try:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise UsageError(f"cannot read the Modelfile '{args.file}': {e.strerror}",
                             "pass its path with -f, or '-f -' to read stdin") from e
        folder = os.path.dirname(os.path.abspath(args.file))
    m = api.create_preset(args.name, text, base_dir=folder)
    if args.json:
        print(json.dumps(m.to_dict(), indent=2))
    else:
        print(f"created {m.name} (preset of {m.base})", file=sys.stderr)
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    """Give a model or preset another name: the same file (a model) or the same settings (a preset)."""
    from localrun import api

    m = api.copy_model(args.source, args.destination)
    print(f"copied {args.source} to {m.name}", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    """Remove models. Files that localrun downloaded or converted are deleted; files registered
    with 'localrun add' are only unregistered."""
    from localrun import api

    removed = [api.remove_model(name) for name in args.models]
    if args.json:
        print(json.dumps([m.to_dict() for m in removed], indent=2))
    else:
        for m in removed:
            kept = m.source in ("added", "starter", "ollama", "lmstudio")
            print(f"removed {m.name}" + (f" (file kept at {m.path})" if kept else "") + _projector_removed(m),
                  file=sys.stderr)
    return 0


def _projector_removed(m: Any) -> str:
    """What became of a removed vision model's projector: deleted with it, or kept (added in place, shared)."""
    import os

    mmproj = m.details.get("mmproj")
    if not mmproj:
        return ""
    return f"; projector kept at {mmproj}" if os.path.exists(mmproj) else f" and its projector {os.path.basename(mmproj)}"


def cmd_add(args: argparse.Namespace) -> int:
    """Register an existing GGUF file (or model folder) in place, without copying it; or, with
    --from, every model that Ollama, LM Studio or the Hugging Face cache holds (an Ollama model
    with its template, system prompt and parameters, as a preset). A file the other tool deletes
    later shows as missing in 'localrun list'."""
    from localrun import api
    from localrun.errors import UsageError

    if args.source:
        if args.name or args.force or args.mmproj:
            raise UsageError("--name, --force and --mmproj name one file; --from registers a whole folder",
                             "drop them, or rename a model afterwards with 'localrun cp'")
        if args.path and args.folder and args.path != args.folder:
            raise UsageError("give the folder once: as PATH or as --path")
        return _import(api.import_models(args.source, args.folder or args.path, dry_run=args.dry_run), args.json)
    if args.path is None:
        raise UsageError("add needs a model file, or --from ollama|lmstudio|hf",
                         "e.g. 'localrun add model.gguf' or 'localrun add --from ollama'")
    if args.folder or args.dry_run:
        raise UsageError("--path and --dry-run go with --from", "give the file as the argument: localrun add FILE")
    m = api.add_model(args.path, name=args.name, replace=args.force, mmproj=args.mmproj)
    if args.json:
        print(json.dumps(m.to_dict(), indent=2))
    else:
        print(f"added {m.name} ({m.path})", file=sys.stderr)
    return 0


def _import(result: Any, as_json: bool) -> int:
    """Print what an import registered, skipped and found gone."""
    from localrun.imports import TITLES

    if as_json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
        return 0
    err = sys.stderr
    verbs = {"added": "added", "updated": "updated", "unchanged": "unchanged"}
    if result.dry_run:
        verbs = {"added": "would add", "updated": "would update", "unchanged": "unchanged"}
    for i in result.imported:
        via = f", a preset of {i.base}" if i.base else ""
        print(f"{verbs[i.status]} {i.name} ({i.origin}{via})", file=err)
        for note in i.notes:
            print(f"  note: {note}", file=err)
    for s in result.skipped:
        print(f"skipped {s.origin}: {s.reason}", file=err)
    for name in result.missing:
        print(f"missing {name}: imported earlier and gone from {TITLES[result.source]} "
              f"(remove it with 'localrun rm {name}')", file=err)
    counts = {k: sum(1 for i in result.imported if i.status == k) for k in verbs}
    done = ", ".join(f"{n} {verbs[k]}" for k, n in counts.items() if n) or "no models found"
    print(f"{TITLES[result.source]} ({result.root}): {done}"
          + (f", {len(result.skipped)} skipped" if result.skipped else "")
          + (" (dry run: nothing registered)" if result.dry_run else ""), file=err)
    return 0
