"""The conversion entry points: a Hugging Face folder or an in-memory model to one GGUF file."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from convert import outtypes
from convert.checkpoint import Checkpoint
from convert.errors import ConvertError
from convert.plan import Plan, build_plan
from convert.progress import ProgressCallback
from convert.quantize import quantize_file
from convert.vocab import load_vocab
from convert.writer import atomic_output, check_space, check_target, temp_path, write_model


@dataclass(frozen=True)
class Result:
    """A finished conversion."""

    path: Path
    plan: Plan
    seconds: float


def default_out(ckpt: Checkpoint, folder: Path, outtype: str) -> Path:
    return folder / f"{ckpt.name}-{outtype.upper()}.gguf"


def _metadata(ckpt: Checkpoint, plan: Plan, name: str | None):  # noqa: ANN202
    vocab = load_vocab(ckpt.tokenizer_dir, ckpt.embedding_rows(), ckpt.arch.add_space_prefix())

    def write(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name or ckpt.name)
        total, shared, expert, n_expert = w.get_total_parameter_count()
        if total > 0:
            w.add_size_label(gguf.size_label(total, shared, expert, n_expert))
        ckpt.arch.write_hparams(w)
        w.add_file_type(outtypes.DIRECT_FTYPE[outtypes.DIRECT[plan.written_type]])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.write(w)

    return write


def run(
    ckpt: Checkpoint,
    out: Path,
    *,
    outtype: str = "auto",
    imatrix: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
    threads: int | None = None,
) -> Result:
    """Plan, check, write (and quantize) one checkpoint."""
    plan, specs = build_plan(ckpt, out, outtype, Path(imatrix) if imatrix else None)
    metadata = _metadata(ckpt, plan, name)  # reads the tokenizer: fails before any writing
    if dry_run:
        return Result(out, plan, 0.0)
    check_target(out, force)
    check_space(out.parent, plan.gguf_bytes + (plan.final_bytes if plan.quantized else 0))
    start = time.monotonic()
    with atomic_output(out) as tmp:
        if not plan.quantized:
            write_model(ckpt, plan, specs, tmp, metadata, progress, threads)
        else:
            inter = temp_path(out, plan.written_type)
            try:
                write_model(ckpt, plan, specs, inter, metadata, progress, threads)
                quantize_file(inter, tmp, plan.outtype, plan.imatrix, threads, progress)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    inter.unlink()
    return Result(out, plan, time.monotonic() - start)


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    outtype: str = "auto",
    imatrix: str | os.PathLike[str] | None = None,
    name: str | None = None,
    force: bool = False,
    dry_run: bool = False,
    progress: ProgressCallback | None = None,
    threads: int | None = None,
) -> Result:
    """Convert a Hugging Face model folder to GGUF.

    Args:
        src: folder with config.json, *.safetensors or pytorch_model*.bin, and tokenizer files.
        out: output .gguf path (default: SRC/<name>-<TYPE>.gguf).
        outtype: auto, f32, f16, bf16, q8_0, or any llama.cpp type (q4_k_m, iq4_xs, ...).
        imatrix: importance matrix for llama.cpp quantization types.
        name: model name stored in general.name (default: the folder name).
        force: overwrite an existing output file.
        dry_run: plan only; nothing is written (the plan is in Result.plan).
        progress: called after each tensor with a Progress event.
        threads: worker threads (default: the CPU count, at most 4).

    Returns:
        Result with the output path, the plan and the time taken.

    Raises:
        ConvertError: unsupported architecture or tokenizer, bad files, existing output, no space.
    """
    ckpt = Checkpoint.open(src)
    normalized = outtypes.normalize(outtype)
    if out is None:
        shown = normalized if normalized != "auto" else outtypes.auto_type(ckpt.source_dtypes())
        out_p = default_out(ckpt, Path(src), shown)
    else:
        out_p = Path(out)
    return run(
        ckpt,
        out_p,
        outtype=normalized,
        imatrix=imatrix,
        name=name,
        force=force,
        dry_run=dry_run,
        progress=progress,
        threads=threads,
    )


def from_module(
    model: Any,
    tokenizer: Any,
    out_path: str | os.PathLike[str],
    outtype: str = "auto",
    *,
    name: str | None = None,
    force: bool = False,
    imatrix: str | os.PathLike[str] | None = None,
    progress: ProgressCallback | None = None,
) -> Result:
    """Convert an in-memory transformers model (e.g. right after fine-tuning) and its tokenizer.

    The weights are read from the module's state dict without a copy on disk; the tokenizer is
    saved to a temporary folder to read its files.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ConvertError(
            "the model has no Hugging Face config", "pass a transformers PreTrainedModel"
        )
    cfg = config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    with tempfile.TemporaryDirectory(prefix="localrun-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        gen = getattr(model, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            with contextlib.suppress(Exception):
                gen.save_pretrained(tmp)
        ckpt = Checkpoint.from_state_dict(
            cfg,
            model.state_dict(),
            Path(tmp),
            name or str(cfg.get("_name_or_path") or "model").rsplit("/", 1)[-1] or "model",
        )
        if ckpt.tokenizer_dir and not any(Path(tmp).iterdir()):
            raise ConvertError("the tokenizer saved no files", "pass a transformers tokenizer")
        return run(
            ckpt,
            Path(out_path),
            outtype=outtype,
            imatrix=imatrix,
            name=name,
            force=force,
            progress=progress,
        )
