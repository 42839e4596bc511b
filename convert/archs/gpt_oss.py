"""gpt-oss: attention with per-head sinks and biases, sliding-window layers alternating with full
ones, a biased top-k router and experts with biases (gate/up interleaved in one fused tensor).

llama.cpp always rounds YaRN's correction range, which the published config's "truncate": false
does not: llama.cpp's logits differ slightly from transformers' there, whatever the converter does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import MoeArch, TensorSpec
from convert.errors import ConvertError

_T = gguf.MODEL_TENSOR
# llama.cpp's graph hard-codes gpt-oss's clamped SwiGLU and every other layer sliding.
_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}
_LAYER_TYPES = ("sliding_attention", "full_attention")
# The published checkpoints' experts: MXFP4 blocks [n_expert, rows, cols / 32, 16], scales beside.
_MXFP4_BLOCKS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_blocks$")


def _mxfp4_items(
    blocks: str, scales: str, n: int, which: int, step: int
) -> Callable[[Mapping[str, Any]], Iterator[Callable[[], np.ndarray]]]:
    """Work items of one stacked MXFP4 tensor, an expert each: rows which, which + step, ... of
    each expert's blocks and scales, repacked as GGUF MXFP4."""

    def produce(tensors: Mapping[str, Any]) -> Iterator[Callable[[], np.ndarray]]:
        b, s = tensors[blocks], tensors[scales]
        for e in range(n):

            def item(e: int = e) -> np.ndarray:
                rows = slice(which, None, step)
                return mxfp4_repack(b.read(e, e + 1)[:, rows], s.read(e, e + 1)[:, rows])

            yield item

    return produce


def _columns(which: int, transpose: bool) -> Callable[[np.ndarray], np.ndarray]:
    """Every other column, from `which` (gate 0, up 1), of each expert's [n_embd, 2 * n_ff] rows
    (or of each expert's bias), transposed to llama.cpp's [n_ff, n_embd] if asked."""

    def fn(w: np.ndarray) -> np.ndarray:
        half = w[..., which::2]
        return half.swapaxes(-1, -2) if transpose else half

    return fn


def _transposed(w: np.ndarray) -> np.ndarray:
    """Each expert's [n_ff, n_embd] down weights as llama.cpp's [n_embd, n_ff]."""
    return w.swapaxes(-1, -2)


@register("GptOssForCausalLM")
class GptOss(MoeArch):
    gguf_arch = gguf.MODEL_ARCH.GPT_OSS
    output_required = True

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        for key, want in _SWIGLU.items():
            if (got := self.config.get(key)) is not None and float(got) != want:
                raise ConvertError(
                    f"config.json sets {key} to {got}; llama.cpp's gpt-oss computes with {want}",
                    "llama.cpp cannot run this variant as it was trained",
                )
        layer_types = self.config.get("layer_types")
        expected = [_LAYER_TYPES[i % 2] for i in range(self.n_layers)]
        if layer_types is not None and list(layer_types) != expected:
            raise ConvertError(
                "config.json's layer_types are not sliding and full attention alternating, "
                "starting with sliding",
                "llama.cpp's gpt-oss fixes that pattern",
            )

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        w.add_sliding_window(int(self.need("sliding_window")))
        if self.get("moe_intermediate_size") is None:  # else MoeArch wrote it
            w.add_expert_feed_forward_length(int(self.need("intermediate_size")))

    def joined_specs(self, shapes: Mapping[str, tuple[int, ...]]) -> list[TensorSpec]:
        out = super().joined_specs(shapes)
        n = self.expert_count()
        for name, shape in shapes.items():
            if (m := _MXFP4_BLOCKS.match(name)) is None:
                continue
            scales = name.removesuffix("_blocks") + "_scales"
            if (
                len(shape) != 4
                or shape[0] != n
                or shape[3] != 16
                or shapes.get(scales) != shape[:3]
            ):
                raise ConvertError(
                    f"MXFP4 tensor {name!r} {list(shape)} and its scales "
                    f"{list(shapes.get(scales) or [])} do not match [{n}, rows, cols / 32, 16]",
                    "the checkpoint does not match its config.json",
                )
            bid, rows, cols = int(m[1]), shape[1], shape[2] * 32
            # gate and up rows interleave, as in the 16-bit layout's columns
            kinds = (
                [(_T.FFN_GATE_EXP, 0, 2), (_T.FFN_UP_EXP, 1, 2)]
                if m[2] == "gate_up_proj"
                else [(_T.FFN_DOWN_EXP, 0, 1)]
            )
            for key, which, step in kinds:
                out.append(
                    TensorSpec(
                        self.tensor_name(key, bid),
                        name,
                        (n, rows // step, cols),
                        qtype=gguf.GGMLQuantizationType.MXFP4,
                        produce=_mxfp4_items(name, scales, n, which, step),
                        also_reads=(scales,),
                    )
                )
        return out

    def gguf_name(self, name: str) -> str:
        if name.endswith(".self_attn.sinks"):
            name += ".weight"
        return super().gguf_name(name)

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if ".mlp.experts." not in name:
            return super().specs(name, shape)
        bid, n = self._bid(name), self.expert_count()
        proj = name.rsplit(".", 1)[-1]
        if proj in ("gate_up_proj", "gate_up_proj_bias"):
            bias = proj.endswith("_bias")
            if len(shape) != (2 if bias else 3) or shape[0] != n or shape[-1] % 2:
                what = "2 * n_ff" if bias else "n_embd, 2 * n_ff"
                raise ConvertError(
                    f"tensor {name!r} has shape {list(shape)}, expected [{n}, {what}]",
                    "the checkpoint does not match its config.json",
                )
            # The fns see whole experts: the writer's blocks of rows are of the first dimension.
            ff = shape[-1] // 2
            out_shape = (n, ff) if bias else (n, ff, shape[1])
            suffix = ".bias" if bias else ".weight"
            return [
                TensorSpec(
                    self.tensor_name(key, bid, suffix),
                    name,
                    out_shape,
                    fn=_columns(which, transpose=not bias),
                )
                for which, key in enumerate((_T.FFN_GATE_EXP, _T.FFN_UP_EXP))
            ]
        if proj == "down_proj":
            self._experts_shape(name, shape, "n_ff, n_embd")
            down = self.tensor_name(_T.FFN_DOWN_EXP, bid)
            return [TensorSpec(down, name, (n, shape[2], shape[1]), fn=_transposed)]
        if proj == "down_proj_bias":
            return [TensorSpec(self.tensor_name(_T.FFN_DOWN_EXP, bid, ".bias"), name, shape)]
        raise ConvertError(
            f"tensor {name!r} has no llama.cpp equivalent for {self.name}",
            "the checkpoint may be a variant this converter does not know",
        )


def mxfp4_repack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 (uint8 blocks [..., n, 16] holding elements 2j and 2j + 1 in the low and
    high nibbles of byte j, E8M0 scales [..., n]) as GGUF MXFP4 rows [..., n * 17]: each block's
    scale byte, then element j in the low and j + 16 in the high nibble of byte j."""
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ConvertError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not match"
        )
    nibbles = np.stack((blocks & 0x0F, blocks >> 4), axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    packed = np.concatenate((scales[..., None], qs), axis=-1)
    return packed.reshape(*scales.shape[:-1], scales.shape[-1] * 17)
