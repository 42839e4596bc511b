"""`localrun convert` and `localrun quantize`: checkpoints to GGUF (the `convert` package, loaded lazily)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from localrun.errors import ConversionError, UsageError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face model folder to GGUF",
        description=cmd_convert.__doc__,
    )
    p.add_argument(
        "src", metavar="SRC", help="Hugging Face model folder (config.json, weights, tokenizer), or a PEFT LoRA "
        "adapter folder (adapter_config.json): converted to a GGUF adapter for its base model"
    )
    p.add_argument(
        "-o", "--output", metavar="OUT", help="output .gguf (default: SRC/<name>-<TYPE>.gguf)"
    )
    p.add_argument(
        "--outtype",
        metavar="TYPE",
        default="auto",
        help="auto (keep F16/BF16), f32, f16, bf16, q8_0, or a llama.cpp type: q4_k_m, q5_k_m, "
        "q6_k, iq4_xs, ...",
    )
    p.add_argument(
        "--imatrix", metavar="FILE", help="importance matrix for llama.cpp quantization types"
    )
    p.add_argument(
        "--mmproj-outtype", metavar="TYPE", default="auto", choices=("auto", "f32", "f16", "bf16", "q8_0"),
        help="a vision-language model's projector (mmproj-*.gguf, written beside the model): auto (the "
        "model's f32/f16/bf16; f16 when the model is quantized), f32, f16, bf16 or q8_0",
    )
    p.add_argument("--name", help="name in the model store (default: from the file name, or from the "
                   "model where another model has that name)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (tensors, types, size); write nothing",
    )
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument(
        "--no-register", action="store_true", help="do not add the result to the model store"
    )
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--base", metavar="MODEL|PATH",
                   help="with an adapter folder: its base model (a name from 'localrun list', a GGUF file or a Hugging "
                   "Face folder; default: the adapter's base_model_name_or_path, found in the store, on disk or in the "
                   "Hugging Face cache)")
    g.add_argument("--lora", action="append", default=[], metavar="ADAPTER_DIR[:SCALE]",
                   help="merge this PEFT LoRA adapter into the weights before conversion and quantization (repeatable)")
    # MLX output (localrun/backends/mlx_convert.py, through mlx-lm's converter).
    p.add_argument("--to", choices=("gguf", "mlx"), default="gguf", help="output format (default gguf)")
    p.add_argument("--q-bits", type=int, choices=(4, 8), help="with --to mlx: quantize to 4 or 8 bits")
    p.add_argument("--q-group-size", type=int, default=64, metavar="N",
                   help="with --to mlx: weights per scale, 32, 64 or 128 (default 64)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser(
        "quantize", help="re-quantize a GGUF file with llama.cpp", description=cmd_quantize.__doc__
    )
    p.add_argument(
        "input", metavar="IN", help="GGUF file to quantize (F32/F16/BF16 for best quality); with --ladder "
        "also a Hugging Face checkpoint folder"
    )
    p.add_argument("type", metavar="TYPE", nargs="?", help="q8_0, q4_k_m, q5_k_m, q6_k, iq4_xs, ...")
    p.add_argument("-o", "--output", metavar="OUT", help="output .gguf (default: IN-TYPE.gguf); "
                   "with --ladder the folder for the rungs and the report (default: IN-ladder/)")
    p.add_argument("--imatrix", metavar="FILE", help="importance matrix (needed by iq1/iq2/iq3_xxs types); "
                   "with --ladder also auto (the default: computed once) or none")
    g = p.add_argument_group("ladder (many types, each measured)")
    g.add_argument("--ladder", metavar="T1,T2,...", help="quantize to each type, evaluate each against the 16-bit "
                   "source (perplexity, KL divergence, top-token agreement), benchmark it, and report")
    g.add_argument("--calibration", metavar="FILE", help="text for the importance matrix (default: localrun's set)")
    g.add_argument("--text", metavar="FILE", help="evaluation text (default: localrun's held-out set)")
    g.add_argument("--max-kld", type=float, default=None, metavar="X",
                   help="the mean KLD the recommended rung may lose (default 0.05)")
    g.add_argument("--ctx", type=int, default=512, help="evaluation context per chunk (default 512)")
    g.add_argument("--chunks", type=int, default=None, help="evaluate at most this many chunks")
    g.add_argument("--bench", default="512,128,3", metavar="P,N,R",
                   help="speed test of each rung: prompt tokens, generated tokens, repetitions (default 512,128,3)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core up to 4)")
    p.add_argument("--name", help="name in the model store (default: from the file name)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument(
        "--no-register", action="store_true", help="do not add the result to the model store"
    )
    p.set_defaults(func=cmd_quantize)


def _convert_module() -> Any:
    try:
        import convert
    except ImportError as e:
        raise UsageError("the converter is not installed", "pip install 'localrun[convert]'") from e
    return convert


def _register(path: Any, name: str | None, replace: bool = False, converted_from: str | None = None,
              mmproj: Any = None) -> None:
    from localrun import api

    info = api.add_model(path, name=name, replace=replace, converted_from=converted_from, mmproj=mmproj)
    print(f"registered as {info.name}", file=sys.stderr)


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a Hugging Face model folder (safetensors or pytorch_model*.bin, F32/F16/BF16) to GGUF.

    Architectures: Llama (2/3.x, TinyLlama, SmolLM), Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3.
    f32/f16/bf16/q8_0 are written directly; other types go through llama.cpp's quantizer from a
    temporary F16/BF16 file. The result is registered in the model store and its path printed.

    A vision-language checkpoint (Qwen2-VL, Qwen2.5-VL, Gemma 3, SmolVLM / Idefics3, LLaVA 1.5 (a
    CLIP tower), LLaVA with a Pixtral vision tower, Mistral Small 3.1/3.2, Ministral 3) becomes two files: the text model and its projector beside it, mmproj-<model file name> with the type in that name made the projector's
    (F16 when the model is quantized; see --mmproj-outtype). The model is registered with its
    projector; both paths are printed, the model's first.

    With --to mlx: an MLX folder through mlx-lm (weights keep their precision unless --q-bits).

    A PEFT LoRA folder (adapter_config.json) becomes a GGUF LoRA adapter, checked against its base
    model and registered linked to it: run it by its name, or with --lora on run, batch, tui, serve.
    --lora ADAPTER_DIR[:SCALE] merges adapters into the weights instead (one file to share).
    """
    from localrun import api

    if api.is_adapter_dir(args.src):
        return _convert_adapter(args)
    if args.base is not None:
        raise UsageError("--base is for converting a LoRA adapter folder",
                         "to merge an adapter into this model, use --lora ADAPTER_DIR")
    if args.to == "mlx" or args.q_bits is not None:
        return _convert_mlx(args)
    lora = [_lora_spec(s) for s in args.lora]
    names: list[str] = []

    def choose_name(planned: Any) -> None:
        # Once planned, before writing: a name another model holds fails now, not after the work.
        if not args.no_register:
            names.append(api.conversion_name(planned.path, args.src, planned.plan.outtype, name=args.name,
                                             replace=args.force))

    progress = None if args.dry_run else _convert_module().StderrProgress()
    res = api.convert_checkpoint(args.src, args.output, outtype=args.outtype, imatrix=args.imatrix,
                                 force=args.force, dry_run=args.dry_run, progress=progress, lora=lora,
                                 before_write=choose_name, mmproj_outtype=args.mmproj_outtype)
    projector = res.mmproj
    if args.dry_run:
        print(res.plan.describe())
        if projector is not None:
            print(f"\nprojector:\n{projector.plan.describe()}")
        return 0
    print(
        f"wrote {res.path} ({res.path.stat().st_size / 1e9:.2f} GB) in {res.seconds:.1f}s",
        file=sys.stderr,
    )
    if projector is not None:
        print(f"wrote the projector {projector.path} ({projector.path.stat().st_size / 1e9:.2f} GB, "
              f"{projector.plan.outtype})", file=sys.stderr)
    for notice in dict.fromkeys(r.plan.notice for r in (res, projector) if r is not None and r.plan.notice):
        print(f"note: {notice}", file=sys.stderr)
    if names:
        _register(res.path, names[0], replace=args.force and args.name is not None,
                  converted_from=None if lora else args.src, mmproj=projector.path if projector else None)
    print(res.path)
    if projector is not None:
        print(projector.path)
    return 0


def _lora_spec(spec: str) -> tuple[str, float]:
    """`ADAPTER_DIR[:SCALE]` for --lora (merging): a PEFT folder and its scale."""
    from pathlib import Path

    from localrun import api
    from localrun.adapters import parse_spec

    folder, scale = parse_spec(spec)
    if not api.is_adapter_dir(folder):
        raise UsageError(f"--lora {spec}: {folder} is not a PEFT adapter folder (no adapter_config.json)",
                         "pass the folder PEFT saved (adapter_config.json, adapter_model.safetensors)")
    return str(Path(folder).resolve()), scale


def _convert_adapter(args: argparse.Namespace) -> int:
    """`convert ADAPTER_DIR`: a GGUF LoRA adapter, registered linked to its base model."""
    from localrun import api

    if args.to != "gguf" or args.q_bits is not None or args.imatrix or args.lora or args.mmproj_outtype != "auto":
        raise UsageError("an adapter folder converts to a GGUF adapter; --to mlx, --q-bits, --imatrix, --lora and "
                         "--mmproj-outtype do not apply", "MLX runs the PEFT folder itself: localrun run BASE --engine mlx --lora DIR")
    result, info = api.convert_adapter(args.src, args.output, base=args.base, outtype=args.outtype, name=args.name,
                                       force=args.force, dry_run=args.dry_run, register=not args.no_register)
    if args.dry_run:
        print(result.describe() if hasattr(result, "describe") else result.path)
        return 0
    print(f"wrote {result.path} ({result.path.stat().st_size / 1e6:.1f} MB, rank {result.rank}, "
          f"{result.tensors} tensors) in {result.seconds:.1f}s", file=sys.stderr)
    if info is not None:
        base_path = (info.details.get("adapter") or {}).get("base_path")
        base = f" (base: {info.base})" if info.base else \
            f" (its base {base_path} is not in the store: convert it with 'localrun convert {base_path}')" \
            if base_path and os.path.isdir(base_path) else \
            " (its base model is not in the store; run it with 'localrun run BASE --lora NAME')"
        print(f"registered as {info.name}{base}", file=sys.stderr)
    print(result.path)
    return 0


def _convert_mlx(args: argparse.Namespace) -> int:
    """`convert --to mlx`: an MLX folder, registered in the store; its path on stdout."""
    from localrun.backends.mlx_convert import convert_to_mlx

    if args.to != "mlx":
        raise UsageError("--q-bits is for MLX output", "add --to mlx, or use --outtype for GGUF")
    if args.lora:
        raise UsageError("--lora merges adapters into GGUF output",
                         "MLX runs the PEFT folder as it is: localrun run MODEL --engine mlx --lora ADAPTER_DIR")
    if (args.outtype != "auto" or args.mmproj_outtype != "auto" or args.imatrix or args.dry_run or args.force
            or args.no_register):
        raise UsageError("--outtype, --mmproj-outtype, --imatrix, --dry-run, --force and --no-register are for "
                         "GGUF output",
                         "with --to mlx use -o, --name, --q-bits and --q-group-size")
    info = convert_to_mlx(args.src, args.output, q_bits=args.q_bits, q_group_size=args.q_group_size,
                          name=args.name, progress=lambda line: print(line, file=sys.stderr))
    print(f"registered as {info.name}", file=sys.stderr)
    print(info.path)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    """Re-quantize an existing GGUF file with llama.cpp (q8_0, q4_k_m, iq4_xs, ...).

    The output is written under a temporary name and renamed when complete, then registered in the
    model store and its path printed.
    """
    if args.ladder is not None:
        return _ladder(args)
    if args.type is None:
        raise UsageError("quantize needs a TYPE, or --ladder T1,T2,...", "e.g. localrun quantize model-F16.gguf q4_k_m")
    convert = _convert_module()
    try:
        out = convert.quantize(
            args.input,
            args.output,
            args.type,
            imatrix=args.imatrix,
            force=args.force,
            progress=convert.StderrProgress(),
        )
    except convert.ConvertError as e:
        raise ConversionError(e.message, e.hint) from e
    if not args.no_register:
        _register(out, args.name)
    print(out)
    return 0


def _ladder(args: argparse.Namespace) -> int:
    """`quantize --ladder`: every rung built, measured and registered; the report on stdout."""
    from localrun import api

    if args.type is not None:
        raise UsageError("give a TYPE or --ladder, not both")
    try:
        pp, tg, reps = (int(x) for x in args.bench.split(","))
    except ValueError:
        raise UsageError(f"--bench {args.bench!r}: expected three numbers P,N,R", "e.g. --bench 512,128,3") from None
    imatrix = args.imatrix or "auto"
    result = api.quantize_ladder(
        args.input, args.ladder.split(","), args.output, imatrix=None if imatrix == "none" else imatrix,
        calibration=args.calibration, text=args.text, budget=args.max_kld, name=args.name, n_ctx=args.ctx,
        chunks=args.chunks, bench=(pp, tg, reps), threads=args.threads,
        progress=lambda line: print(f"ladder: {line}", file=sys.stderr, flush=True))
    print(api.ladder_report(result), end="")
    return 0
