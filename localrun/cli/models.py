"""`localrun list`, `show`, `rm`, `add`: the local model store."""

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
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("rm", help="remove a model", description=cmd_rm.__doc__)
    p.add_argument("models", nargs="+", metavar="MODEL", help="model name(s)")
    p.add_argument("--json", action="store_true", help="print what was removed as JSON")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("add", help="register an existing GGUF file in place", description=cmd_add.__doc__)
    p.add_argument("path", help="a .gguf file (or an MLX / Hugging Face model folder)")
    p.add_argument("--name", help="short name, e.g. mymodel:q4 (default: from the file name)")
    p.add_argument("--force", action="store_true", help="replace a model of the same name")
    p.add_argument("--json", action="store_true", help="print the registered model as JSON")
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
         human_size(m.size), str(m.context_length or "-"), m.details.get("error", "") or _adapter_note(m)]
        for m in models
    ]
    print(_table(rows, ["NAME", "FORMAT", "ARCH", "PARAMS", "QUANT", "SIZE", "CONTEXT", ""]))
    return 0


def _adapter_note(m: Any) -> str:
    if not m.is_adapter:
        return ""
    return f"LoRA adapter of {m.base}" if m.base else "LoRA adapter (base not in the store)"


def cmd_show(args: argparse.Namespace) -> int:
    """Show a model's architecture, parameters, quantization, context, tokenizer, licence, chat
    template and other metadata."""
    from localrun import api

    m = api.get_model(args.model)
    if args.template:
        print(m.details.get("chat_template") or "")
        return 0
    from localrun.gguf_header import model_experts

    experts = model_experts(m.details)
    context = None if m.is_adapter else api.default_context(m)
    if args.json:
        out = m.to_dict(with_details=True)
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
    if d.get("chat_template"):
        print("\nchat template")
        print("  " + d["chat_template"].replace("\n", "\n  "))
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
            kept = m.source in ("added", "starter")
            print(f"removed {m.name}" + (f" (file kept at {m.path})" if kept else ""), file=sys.stderr)
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    """Register an existing GGUF file (or model folder) in place, without copying it."""
    from localrun import api

    m = api.add_model(args.path, name=args.name, replace=args.force)
    if args.json:
        print(json.dumps(m.to_dict(), indent=2))
    else:
        print(f"added {m.name} ({m.path})", file=sys.stderr)
    return 0
