"""`localrun search` and `localrun pull`: find and fetch models on the Hugging Face Hub."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from localrun.cli.models import _table
from localrun.cli.options import cpu_moe_layers
from localrun.units import count as human_count
from localrun.units import experts as experts_text
from localrun.units import size as human_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("search", help="search the Hugging Face Hub", description=cmd_search.__doc__)
    p.add_argument("query", nargs="?", default="", help="words in the repository name")
    p.add_argument("--files", metavar="REPO", help="list a repository's model files, sizes and quantizations")
    p.add_argument("--format", choices=["gguf", "mlx", "safetensors"], help="only repositories in this format")
    p.add_argument("--sort", choices=["downloads", "likes", "updated"], default="downloads")
    p.add_argument("--limit", type=int, default=20, help="at most N repositories (default 20)")
    p.add_argument("--revision", help="with --files: a branch, tag or commit")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("pull", help="download a model from the Hugging Face Hub", description=cmd_pull.__doc__)
    p.add_argument("model", metavar="REPO[:QUANT|:FILE]", help="e.g. Qwen/Qwen3-0.6B-GGUF:Q4_K_M")
    p.add_argument("--revision", help="a branch, tag or commit (default main)")
    p.add_argument("--name", help="short name in the store (default: from the repository and quantization)")
    p.add_argument("--check", action="store_true",
                   help="estimate the memory needed and stop, downloading nothing (exit 3: will not fit)")
    p.add_argument("--ctx", type=int, help="context size for the memory estimate (default: the engines' default)")
    p.add_argument("--cpu-moe", type=cpu_moe_layers, default=0, metavar="N|all",
                   help="with --check: a mixture-of-experts model's expert weights of the first N layers (all: "
                        "every layer) stay in RAM, as 'run --cpu-moe N' keeps them")
    p.add_argument("--json", action="store_true", help="print the installed model (or the estimate) as JSON")
    p.set_defaults(func=cmd_pull)


def cmd_search(args: argparse.Namespace) -> int:
    """Search Hub repositories (downloads, likes, last update, formats), or list one repository's
    model files with --files REPO."""
    from localrun import api

    if args.files:
        return _files(args)
    results = api.search_models(args.query, format=args.format, sort=args.sort, limit=args.limit)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        return 0
    if not results:
        print(f"no repositories match '{args.query}'", file=sys.stderr)
        return 0
    rows = [[r.id + (" (gated)" if r.gated else ""), ",".join(r.formats) or "-", human_count(r.downloads),
             human_count(r.likes), (r.last_modified or "-")[:10]] for r in results]
    print(_table(rows, ["REPOSITORY", "FORMATS", "DOWNLOADS", "LIKES", "UPDATED"]))
    return 0


def _files(args: argparse.Namespace) -> int:
    from localrun import api

    listing = api.list_repo_files(args.files, revision=args.revision)
    if args.json:
        print(json.dumps({"repo": listing.repo, "commit": listing.commit, "default": listing.default,
                          "files": [f.to_dict() for f in listing.files]}, indent=2))
        return 0
    rows = []
    for f in listing.files:
        if not f.is_weights:
            continue
        mark = "*" if f.path in listing.default else ""
        rows.append([f.path, human_size(f.size), f.quant or "-", mark])
    if not rows:
        print(f"'{listing.repo}' has no model files", file=sys.stderr)
        return 0
    print(_table(rows, ["FILE", "SIZE", "QUANT", "DEFAULT"]))
    if listing.default_quant:
        print(f"pull the default with 'localrun pull {listing.repo}', another with"
              f" 'localrun pull {listing.repo}:QUANT'", file=sys.stderr)
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a model into the Hugging Face cache and install it under a short name.

    GGUF repositories: choose the file by quantization (REPO:Q4_K_M; default Q4_K_M, else the
    closest at or above 4 bits) or by name (REPO:FILE.gguf); split GGUFs are one model. A vision
    model's projector (mmproj file) comes with it: F16 when there are several, else BF16, else F32.
    Safetensors and MLX repositories: only the weights, config and tokenizer files.
    Interrupted downloads resume; every file is checked against the Hub's sha256."""
    from localrun import api
    from localrun.errors import CancelledError

    if args.check:
        est = api.estimate_fit(args.model, revision=args.revision, context=args.ctx, cpu_moe=args.cpu_moe)
        if args.json:
            print(json.dumps(est.to_dict(), indent=2))
        else:
            print(_fit_text(est))
        return 0 if est.verdict != "none" else 3
    bars = _Bars()
    try:
        with bars:
            result = api.pull(args.model, revision=args.revision, name=args.name, progress=bars.update,
                              notice=bars.notice, context=args.ctx)
    except KeyboardInterrupt:
        raise CancelledError("pull interrupted; what was downloaded is kept",
                             f"run 'localrun pull {args.model}' again to resume") from None
    m = result.model
    if args.json:
        print(json.dumps({**m.to_dict(), "repo": result.plan.repo, "commit": result.plan.commit,
                          "files": [f.path for f in result.plan.files], "projector": _projector_json(result),
                          "downloaded_bytes": result.downloaded_bytes,
                          "already_installed": result.already_installed}, indent=2))
        return 0
    if result.plan.projector is not None:
        print(_projector_text(result.plan), file=sys.stderr)
    if result.already_installed:
        print(f"{m.name} is already installed ({result.plan.repo} at {result.plan.commit[:7]})", file=sys.stderr)
    else:
        kind = ", vision" if m.details.get("mmproj") else ""
        print(f"installed {m.name} ({human_size(m.size)}, {m.quantization or m.format}{kind})"
              f"; run it with 'localrun run {m.name}'", file=sys.stderr)
    return 0


def _projector_text(plan: Any) -> str:
    """E.g. "projector: mmproj-F16.gguf (878 MB, chosen from 3)"."""
    f = plan.projector
    n = len(plan.projector_choices)
    return f"projector: {f.path} ({human_size(f.size)}" + (f", chosen from {n})" if n > 1 else ")")


def _projector_json(result: Any) -> dict[str, Any] | None:
    p = result.plan
    if p.projector is None:
        return None
    return {"file": p.projector.path, "size": p.projector.size, "chosen_from": list(p.projector_choices),
            "path": result.model.details.get("mmproj")}


def _fit_text(est: Any) -> str:
    rows = [
        ("model", f"{est.repo} ({', '.join(est.files[:3])}{', …' if len(est.files) > 3 else ''})"),
        ("architecture", est.architecture or "-"),
        *_parameter_rows(est),
        ("weights", human_size(est.weights_bytes)),
        *([("projector", f"{human_size(est.projector_bytes)} ({est.projector}, loaded with the model)")]
          if est.projector else []),
        ("KV cache", f"{human_size(est.kv_cache_bytes)} at {est.context} tokens of context"),
        ("buffers", human_size(est.overhead_bytes) + (f" (llama.cpp's compute buffer {human_size(est.compute_bytes)},"
                                                      f" output {human_size(est.output_bytes)})" if est.compute_bytes else "")),
        ("total", human_size(est.total_bytes)),
        *([("download", human_size(est.download_bytes) + (" (the projector included)" if est.projector else ""))]
          if est.download_bytes else []),
        ("RAM", f"{human_size(est.ram_available)} available of {human_size(est.ram_total)}"),
    ]
    if est.gpu_name:
        rows.append(("GPU", f"{est.gpu_name}, {human_size(est.gpu_bytes)}"))
    if est.host_bytes:
        rows.append(("placement", f"{human_size(est.device_bytes)} on the GPU, {human_size(est.host_bytes)} of"
                                  f" expert weights in RAM (--cpu-moe {est.cpu_moe_layers})"))
    rows.append(("verdict", est.verdict_text))
    if est.suggested_cpu_moe is not None and est.experts:
        n = est.suggested_cpu_moe
        rows.append(("hint", f"with --cpu-moe {n} it fits on the GPU ({human_size(est.experts.host_bytes(n))}"
                             " of expert weights stay in RAM)"))
    return "\n".join(f"{k:<14}{v}" for k, v in rows)


def _parameter_rows(est: Any) -> list[tuple[str, str]]:
    """Parameters (and the active ones of a mixture-of-experts model) and its experts."""
    if not est.parameters:
        return []
    params = human_count(est.parameters)
    if est.active_parameters is None or est.experts is None:
        return [("parameters", params)]
    e = est.experts
    return [("parameters", f"{params} ({human_count(est.active_parameters)} active)"),
            ("experts", f"{experts_text(e.count, e.used, e.shared)}, {human_size(e.expert_bytes)} of weights")]


class _Bars:
    """One rich progress bar per file on stderr: bytes, speed and ETA."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self.console = Console(stderr=True)
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=self.console, transient=False,
        )
        self.tasks: dict[str, Any] = {}

    def __enter__(self) -> _Bars:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tasks:
            self.progress.stop()

    def update(self, event: Any) -> None:
        task = self.tasks.get(event.filename)
        label = {"verify": "verifying ", "cached": "cached "}.get(event.phase, "")
        if task is None:
            if not self.tasks:
                self.progress.start()
            task = self.tasks[event.filename] = self.progress.add_task(
                event.filename, total=event.total, completed=event.resumed)
        self.progress.update(task, completed=event.done, description=f"{label}{event.filename}")

    def notice(self, message: str) -> None:
        self.console.print(f"localrun: warning: {message}", markup=False, highlight=False, soft_wrap=True)
