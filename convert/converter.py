"""The conversion entry points: a Hugging Face folder or an in-memory model to one GGUF file, and
a PEFT LoRA adapter to a llama.cpp GGUF adapter."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from convert import outtypes
from convert.checkpoint import Checkpoint, open_base
from convert.errors import ConvertError
from convert.lora import (
    Adapter,
    AdapterTensor,
    gguf_adapter_tensors,
    read_adapter,
    read_adapters,
)
from convert.mmproj import plan_projector
from convert.plan import Plan, build_plan
from convert.progress import ProgressCallback
from convert.quantize import quantize_file
from convert.vocab import load_vocab
from convert.writer import (
    atomic_output,
    check_space,
    check_target,
    remove_stale_temps,
    temp_path,
    write_model,
)

LoraSpec = Sequence[tuple[str | os.PathLike[str] | Adapter, float]]


@dataclass(frozen=True)
class Result:
    """A finished conversion."""

    path: Path
    plan: Plan
    seconds: float
    mmproj: Result | None = None  # a vision-language checkpoint's projector file, written beside


def default_out(ckpt: Checkpoint, folder: Path, outtype: str, adapters: Sequence[str] = ()) -> Path:
    merged = "".join(f"-{a}" for a in adapters)
    return folder / f"{ckpt.name}{merged}-{outtype.upper()}.gguf"


def _metadata(ckpt: Checkpoint, plan: Plan, name: str | None):  # noqa: ANN202
    vocab = ckpt.arch.load_vocab(ckpt.tokenizer_dir, ckpt.embedding_rows()) or \
        load_vocab(ckpt.tokenizer_dir, ckpt.embedding_rows(), ckpt.arch.add_space_prefix())
    add_bos = ckpt.arch.add_bos_token()
    if add_bos is not None:
        vocab.special.add_special_token["bos"] = add_bos

    def write(w: gguf.GGUFWriter) -> None:
        ftype = outtypes.DIRECT_FTYPE[outtypes.DIRECT[plan.written_type]]
        if any(t.qtype == gguf.GGMLQuantizationType.MXFP4 for t in plan.tensors):
            ftype = gguf.LlamaFileType.MOSTLY_MXFP4_MOE  # as llama.cpp's converter labels it
        write_header(w, gguf.GGUFType.MODEL, ckpt, name, ftype)
        vocab.write(w)

    return write


def write_header(w: gguf.GGUFWriter, kind: str, ckpt: Checkpoint, name: str | None, ftype: int) -> None:
    """What every file the converter writes starts with (a model's or a projector's): its type,
    name, size label, the architecture's hyperparameters and the file type."""
    w.add_type(kind)
    w.add_name(name or ckpt.name)
    total, shared, expert, n_expert = w.get_total_parameter_count()
    if total > 0:
        w.add_size_label(gguf.size_label(total, shared, expert, n_expert))
    ckpt.arch.write_hparams(w)
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


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
    lora: LoraSpec | None = None,
    before_write: Callable[[Result], None] | None = None,
    mmproj_outtype: str | None = None,
) -> Result:
    """Plan, check, write (and quantize) one checkpoint, with LoRA adapters merged if given.

    before_write: called with the planned result (path and plan) once the plan, the tokenizer and
    the output path are checked, before anything is written; an exception from it stops there.
    mmproj_outtype: set, a vision-language checkpoint's projector is written too, beside out."""
    if lora:
        ckpt = ckpt.merge(read_adapters(lora))  # checks every shape before any writing
    plan, specs = build_plan(ckpt, out, outtype, Path(imatrix) if imatrix else None)
    metadata = _metadata(ckpt, plan, name)  # reads the tokenizer: fails before any writing
    job = None
    if mmproj_outtype is not None:
        job = plan_projector(ckpt, plan, mmproj_outtype, name)
    projected = Result(job.plan.out, job.plan, 0.0) if job else None
    if dry_run:
        return Result(out, plan, 0.0, projected)
    check_target(out, force)
    if job:
        check_target(job.plan.out, force)
    if before_write is not None:
        before_write(Result(out, plan, 0.0, projected))
    remove_stale_temps(out)
    needed = plan.gguf_bytes + (plan.final_bytes if plan.quantized else 0)
    if job:
        remove_stale_temps(job.plan.out)
        needed += job.plan.gguf_bytes
    check_space(out.parent, needed)
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
        if job:
            # inside the model's own atomic write: a failure here leaves neither file
            projector_start = time.monotonic()
            with atomic_output(job.plan.out) as ptmp:
                write_model(job.ckpt, job.plan, job.specs, ptmp, job.metadata, progress, threads)
            projected = Result(job.plan.out, job.plan, time.monotonic() - projector_start)
    return Result(out, plan, time.monotonic() - start, projected)


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
    lora: LoraSpec | None = None,
    before_write: Callable[[Result], None] | None = None,
    mmproj_outtype: str = "auto",
) -> Result:
    """Convert a Hugging Face model folder to GGUF (and a vision-language one's projector).

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
        lora: (PEFT LoRA folder, scale) pairs merged into the weights before conversion and
            quantization: W + scale * scaling * (B @ A), block by block in float32; several add
            up. modules_to_save weights replace the base tensor (the scale does not apply).
        before_write: called with the planned Result (output path and plan) before anything is
            written (e.g. to choose or refuse a name for the output).
        mmproj_outtype: a vision-language checkpoint's projector (llama.cpp's mmproj file, written
            beside the model as mmproj-<model file name>, the type in that name made its own):
            auto (the model's type for f32/f16/bf16, else f16), f32, f16, bf16 or q8_0.

    Returns:
        Result with the output path, the plan and the time taken; Result.mmproj the projector's.

    Raises:
        ConvertError: unsupported architecture or tokenizer, bad files, existing output, no space,
            an adapter that does not fit the checkpoint.
    """
    ckpt = Checkpoint.open(src)
    adapters = read_adapters(lora or ())
    normalized = outtypes.normalize(outtype)
    if out is None:
        shown = normalized if normalized != "auto" else outtypes.auto_type(ckpt.source_dtypes())
        out_p = default_out(ckpt, Path(src), shown, [a.name for a, _ in adapters])
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
        lora=adapters,
        before_write=before_write,
        mmproj_outtype=mmproj_outtype,
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


# --- PEFT LoRA adapters to llama.cpp adapters --------------------------------------------------

ADAPTER_TYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class AdapterResult:
    """A converted (or, with dry_run, planned) GGUF LoRA adapter."""

    path: Path
    arch: str  # general.architecture, e.g. llama
    rank: int  # r of adapter_config.json
    ranks: tuple[int, ...]  # every rank in the file (rank_pattern may add some)
    alpha: float  # adapter.lora.alpha as written (lora_alpha * sqrt(r) for rsLoRA)
    targets: tuple[str, ...]  # target module names: q_proj, down_proj, ...
    base_model: str | None  # base_model_name_or_path of adapter_config.json
    n_tensors: int
    outtype: str
    skipped: tuple[str, ...]  # whole norm tensors llama.cpp would ignore
    seconds: float

    @property
    def tensors(self) -> int:
        """The number of tensors (n_tensors)."""
        return self.n_tensors

    def describe(self) -> str:
        """A human-readable summary (for --dry-run)."""
        ranks = ", ".join(map(str, self.ranks))
        lines = [
            f"base model: {self.base_model or '(not recorded)'}",
            f"architecture: {self.arch}",
            f"output: {self.path}",
            f"type: {self.outtype}",
            f"rank: {self.rank}" + (f" (per module: {ranks})" if len(self.ranks) > 1 else ""),
            f"alpha: {self.alpha:g}",
            f"targets: {', '.join(self.targets)}",
            f"{self.n_tensors} tensors",
        ]
        if self.skipped:
            lines.append(f"skipped (llama.cpp ignores them): {', '.join(self.skipped)}")
        return "\n".join(lines)


def _adapter_outtype(outtype: str, tensors: list[AdapterTensor]) -> str:
    name = outtype.lower()
    if name == "auto":
        dtypes = {t.source.dtype for t in tensors}
        return dtypes.pop().lower() if len(dtypes) == 1 else "f32"
    if name not in ADAPTER_TYPES:
        raise ConvertError(
            f"adapters are written as f32, f16 or bf16, not {outtype!r}",
            "pass --outtype auto, f32, f16 or bf16",
        )
    return name


def _tensor_bytes(t: AdapterTensor, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    data = t.source.read()
    if t.fn is None:
        return outtypes.encode(data, t.source.dtype, qtype)
    values = t.fn(outtypes.to_f32(data, t.source.dtype))
    return outtypes.encode(np.ascontiguousarray(values), t.source.dtype, qtype, converted=True)


def _write_adapter(
    path: Path,
    arch: str,
    tensors: list[AdapterTensor],
    qtype: gguf.GGMLQuantizationType,
    metadata: Callable[[gguf.GGUFWriter], None],
) -> None:
    """Header first, then each tensor as it is read: never the whole adapter in memory."""
    w = gguf.GGUFWriter(path=None, arch=arch)
    for t in tensors:
        nbytes = outtypes.nbytes(t.shape, qtype)
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    metadata(w)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    try:
        for t in tensors:
            w.write_tensor_data(_tensor_bytes(t, qtype))
        assert w.fout is not None
        w.fout[0].flush()
        os.fsync(w.fout[0].fileno())
    finally:
        w.close()


def convert_adapter(
    adapter_dir: str | os.PathLike[str],
    base: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    outtype: str = "auto",
    name: str | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> AdapterResult:
    """Convert a PEFT LoRA adapter folder to a llama.cpp GGUF LoRA adapter.

    Args:
        adapter_dir: folder with adapter_config.json and adapter_model.safetensors (or .bin).
        base: the base model the adapter was trained on: its Hugging Face folder (config.json and
            weights) or its GGUF file; every adapter tensor is checked against it.
            `read_adapter(adapter_dir).base_model` tells which model the adapter names.
        out: output .gguf path (default: ADAPTER_DIR/<folder>-<TYPE>-LoRA.gguf).
        outtype: auto (the adapter's own dtype), f32, f16 or bf16.
        name: general.name (default: the adapter folder name).
        force: overwrite an existing output file.
        dry_run: check and plan only; nothing is written.

    Returns:
        AdapterResult with the output path, ranks, alpha, targets and the time taken.

    Raises:
        ConvertError: not a LoRA adapter (IA3, prompt tuning, DoRA, ...), whole weights
            (modules_to_save), a base it does not fit, bad files, an existing output.
    """
    start = time.monotonic()
    adapter = read_adapter(adapter_dir)
    hint = "pass the base model's Hugging Face folder or GGUF file with --base"
    if adapter.base_model:
        hint += f" (the adapter was trained on {adapter.base_model!r})"
    base_model = open_base(base, hint)
    tensors, skipped = gguf_adapter_tensors(adapter, base_model)
    written = _adapter_outtype(outtype, tensors)
    qtype = outtypes.DIRECT[written]
    folder = Path(adapter_dir)
    out_p = Path(out) if out is not None else folder / f"{adapter.name}-{written.upper()}-LoRA.gguf"
    arch = base_model.arch.name
    result = AdapterResult(
        path=out_p,
        arch=arch,
        rank=adapter.rank,
        ranks=adapter.ranks,
        alpha=adapter.gguf_alpha,
        targets=adapter.target_modules,
        base_model=adapter.base_model,
        n_tensors=len(tensors),
        outtype=written,
        skipped=tuple(skipped),
        seconds=0.0,
    )
    if dry_run:
        return result
    check_target(out_p, force)
    remove_stale_temps(out_p)
    check_space(out_p.parent, sum(outtypes.nbytes(t.shape, qtype) for t in tensors))

    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_name(name or adapter.name)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, adapter.gguf_alpha)
        w.add_file_type(outtypes.DIRECT_FTYPE[qtype])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        if tokens := adapter.invocation_tokens:
            w.add_key_value(
                gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS,
                tokens,
                gguf.GGUFValueType.ARRAY,
                gguf.GGUFValueType.UINT32,
            )

    with atomic_output(out_p) as tmp:
        _write_adapter(tmp, arch, tensors, qtype, metadata)
    return dataclasses.replace(result, seconds=time.monotonic() - start)
