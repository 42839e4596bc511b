"""The projector file (llama.cpp's mmproj, architecture clip) planned beside a vision-language
model: its type, its name and its metadata."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf

from convert import outtypes
from convert.archs import TensorSpec
from convert.checkpoint import Checkpoint
from convert.errors import ConvertError
from convert.plan import Plan, build_plan

# The types a projector is written as (by the converter itself; llama.cpp's quantizer takes no clip file).
PROJECTOR_TYPES = ("auto", "f32", "f16", "bf16", "q8_0")


def projector_outtype(mmproj_outtype: str, plan: Plan) -> str:
    """The projector's type: the model's own when written as f32, f16 or bf16; F16 when the model
    is quantized (q8_0 or a llama.cpp type), unless mmproj_outtype asks for another."""
    name = mmproj_outtype.lower()
    if name not in PROJECTOR_TYPES:
        raise ConvertError(
            f"a projector is written as f32, f16, bf16 or q8_0, not {mmproj_outtype!r}",
            "pass --mmproj-outtype auto, f32, f16, bf16 or q8_0",
        )
    if name != "auto":
        return name
    return plan.outtype if plan.outtype in ("f32", "f16", "bf16") else "f16"


def projector_out(out: Path, model_type: str, projector_type: str) -> Path:
    """mmproj-<the model's file name> beside it, a type in that name (-Q4_K_M, -q8_0) changed to the
    projector's: vl-Q4_K_M.gguf gets mmproj-vl-F16.gguf."""
    name = out.name
    tags = list(re.finditer(rf"(?<=[-_.]){re.escape(model_type)}(?=[-_.])", name, re.IGNORECASE))
    if tags and model_type != projector_type:
        tag = tags[-1]
        new = projector_type.upper() if tag[0].isupper() else projector_type
        name = name[: tag.start()] + new + name[tag.end() :]
    return out.with_name(f"mmproj-{name}")


def _metadata(ckpt: Checkpoint, plan: Plan, name: str | None):  # noqa: ANN202
    from convert.converter import write_header

    def write(w: gguf.GGUFWriter) -> None:
        write_header(w, gguf.GGUFType.MMPROJ, ckpt, name, outtypes.DIRECT_FTYPE[outtypes.DIRECT[plan.written_type]])

    return write


@dataclass(frozen=True)
class ProjectorJob:
    """The projector file planned beside a vision-language model."""

    ckpt: Checkpoint
    plan: Plan
    specs: list[TensorSpec]
    metadata: Callable[[gguf.GGUFWriter], None]


def plan_projector(
    ckpt: Checkpoint, plan: Plan, outtype: str, name: str | None
) -> ProjectorJob | None:
    """The projector beside a model's plan, for a vision-language checkpoint (else None)."""
    proj = ckpt.projector()
    if proj is None:
        return None
    ptype = projector_outtype(outtype, plan)
    path = projector_out(plan.out, plan.outtype, ptype)
    pplan, pspecs = build_plan(proj, path, ptype)
    return ProjectorJob(proj, pplan, pspecs, _metadata(proj, pplan, name))
