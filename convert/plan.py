"""The conversion plan: every output tensor's name, shape and type, and the file size."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGMLQuantizationType as Q

from convert import outtypes
from convert.archs import TensorSpec
from convert.checkpoint import Checkpoint
from convert.errors import ConvertError

_TOKEN_EMBD = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD] + ".weight"
_OUTPUT = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the output file."""

    name: str
    shape: tuple[int, ...]  # numpy order (rows first); GGUF lists it reversed
    qtype: Q
    nbytes: int
    source: str
    source_dtype: str


@dataclass(frozen=True)
class Plan:
    """What a conversion will write."""

    source: str
    out: Path
    arch: str
    outtype: str  # what the user gets (e.g. q4_k_m)
    written_type: str  # what the converter writes itself (f32/f16/bf16/q8_0)
    tensors: tuple[PlannedTensor, ...]
    gguf_bytes: int  # size of the directly written file
    final_bytes: int  # estimated size of the result
    imatrix: Path | None = None
    notice: str | None = None  # the architecture's word on how llama.cpp runs the file

    @property
    def quantized(self) -> bool:
        return self.outtype != self.written_type

    def describe(self) -> str:
        """A human-readable table of the plan (for --dry-run)."""
        width = max((len(t.name) for t in self.tensors), default=10)
        lines = [
            f"source: {self.source}",
            f"architecture: {self.arch}",
            f"output: {self.out}",
            f"type: {self.outtype}"
            + (
                f" (llama.cpp quantization of a {self.written_type} intermediate)"
                if self.quantized
                else ""
            ),
            "",
            f"{'tensor':<{width}}  {'shape':<20} {'from':<5} type",
        ]
        for t in self.tensors:
            shape = "x".join(str(d) for d in reversed(t.shape))
            lines.append(f"{t.name:<{width}}  {shape:<20} {t.source_dtype:<5} {t.qtype.name}")
        if self.quantized:
            lines.append(
                "(tensor types above are the intermediate's; llama.cpp picks the final mix)"
            )
        lines.append("")
        lines.append(
            f"{len(self.tensors)} tensors, output size {_human(self.final_bytes)}"
            + (" (estimated)" if self.quantized else "")
        )
        if self.notice:
            lines.append(f"note: {self.notice}")
        return "\n".join(lines)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def specs(ckpt: Checkpoint) -> list[TensorSpec]:
    """Every output tensor, in source order, then the embeddings' copy as the output matrix
    where the family needs one and the checkpoint has none, then the generated ones.

    A tensor made from several sources (stacked experts) comes where its first source is.
    """
    joined: dict[str, list[TensorSpec]] = {}
    consumed: set[str] = set()
    for spec in ckpt.arch.joined_specs({name: t.shape for name, t in ckpt.tensors.items()}):
        joined.setdefault(spec.sources[0], []).append(spec)
        consumed.update(spec.sources)
    out: list[TensorSpec] = []
    seen: set[str] = set()
    for name, t in ckpt.tensors.items():
        made = joined.pop(name, [])
        if name not in consumed:
            made += ckpt.arch.specs(name, t.shape)
        for spec in made:
            if spec.name in seen:
                raise ConvertError(f"two source tensors map to {spec.name!r}", f"check {name!r}")
            if spec.pieces:
                _check_pieces(ckpt, spec)
            seen.add(spec.name)
            out.append(spec)
    out = ckpt.arch.ordered(out)
    if not ckpt.arch.has_vocab:
        return out + ckpt.arch.extra_tensors()  # a projector: no embeddings, no output matrix
    embeddings = next((s for s in out if s.name == _TOKEN_EMBD), None)
    if embeddings is None:
        raise ConvertError("the checkpoint has no token embeddings", "the weights look incomplete")
    if ckpt.arch.output_required and _OUTPUT not in seen:
        # tied embeddings, which llama.cpp's graph for this family does not reuse: a copy
        out.append(dataclasses.replace(embeddings, name=_OUTPUT))
    out += ckpt.arch.extra_tensors()
    return out


def _check_pieces(ckpt: Checkpoint, spec: TensorSpec) -> None:
    """A tensor made of pieces: each one exists, and together they fill the tensor exactly."""
    cols = spec.shape[-1] if spec.shape else 1
    rows = 0
    for p in spec.pieces:
        src = ckpt.tensors.get(p.source)
        if src is None:
            raise ConvertError(f"{spec.name} needs {p.source!r}, which the checkpoint lacks")
        stop = src.matrix_rows if p.stop is None else p.stop
        src_cols = src.shape[-1] if src.shape else 1
        if src_cols != cols or not 0 <= p.start < stop <= src.matrix_rows:
            raise ConvertError(
                f"{spec.name}: rows {p.start}..{stop} of {p.source!r} {list(src.shape)} do not fit"
            )
        rows += stop - p.start
    if rows * cols != int(math.prod(spec.shape)):
        raise ConvertError(f"{spec.name}: its pieces hold {rows} rows, not {list(spec.shape)}")


def build_plan(
    ckpt: Checkpoint, out: Path, outtype: str, imatrix: Path | None = None
) -> tuple[Plan, list[TensorSpec]]:
    """Decide each tensor's type and the sizes."""
    outtype = outtypes.normalize(outtype)
    if outtype == "auto":
        outtype = outtypes.auto_type(ckpt.source_dtypes())
    if outtype in outtypes.DIRECT:
        written = outtype
        if imatrix is not None:
            raise ConvertError(
                f"--imatrix applies to llama.cpp quantization types, not {outtype}",
                "drop --imatrix or pick a type such as q4_k_m",
            )
    else:
        written = "bf16" if "BF16" in ckpt.source_dtypes() else "f16"
        if outtype in outtypes.NEEDS_IMATRIX and imatrix is None:
            raise ConvertError(
                f"{outtype} needs an importance matrix",
                "pass --imatrix FILE (made by llama-imatrix) or choose another type",
            )
        if imatrix is not None and not Path(imatrix).is_file():
            raise ConvertError(f"imatrix file {imatrix} does not exist")
    wtype = outtypes.DIRECT[written]
    planned: list[PlannedTensor] = []
    all_specs = specs(ckpt)
    for s in all_specs:
        qtype = s.qtype if s.qtype is not None else ckpt.arch.tensor_type(s.name, s.shape, wtype)
        src_dtype = ckpt.tensors[s.source].dtype if s.source else "F32"
        planned.append(
            PlannedTensor(
                s.name, s.shape, qtype, outtypes.nbytes(s.shape, qtype), s.source, src_dtype
            )
        )
    gguf_bytes = sum(t.nbytes for t in planned)
    final = gguf_bytes
    if outtype != written:
        big = sum(int(t.nbytes // 2) for t in planned if len(t.shape) >= 2)
        small = sum(t.nbytes for t in planned if len(t.shape) < 2)
        final = outtypes.estimate_quantized(big, small, outtype)
    plan = Plan(
        source=ckpt.name,
        out=out,
        arch=ckpt.arch.name,
        outtype=outtype,
        written_type=written,
        tensors=tuple(planned),
        gguf_bytes=gguf_bytes,
        final_bytes=final,
        imatrix=Path(imatrix) if imatrix is not None else None,
        notice=ckpt.arch.notice,
    )
    return plan, all_specs
