"""Output types: the four written directly, and every llama.cpp quantization type."""

from __future__ import annotations

import functools
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType as F

from convert.errors import ConvertError
from convert.source import DTYPES

# Written by the converter itself (numpy / gguf-py).
DIRECT: dict[str, Q] = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
DIRECT_FTYPE: dict[Q, F] = {
    Q.F32: F.ALL_F32,
    Q.F16: F.MOSTLY_F16,
    Q.BF16: F.MOSTLY_BF16,
    Q.Q8_0: F.MOSTLY_Q8_0,
}

# Made by llama.cpp's llama_model_quantize from an F16/BF16 intermediate.
LLAMA_CPP: dict[str, F] = {
    name.lower(): F[f"MOSTLY_{name}"]
    for name in (
        "Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q2_K_S Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q4_K_M Q5_K_S Q5_K_M Q6_K "
        "IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ2_M IQ3_XXS IQ3_XS IQ3_S IQ3_M IQ4_NL IQ4_XS TQ1_0 TQ2_0"
    ).split()
}
ALIASES = {"q3_k": "q3_k_m", "q4_k": "q4_k_m", "q5_k": "q5_k_m"}
# llama.cpp refuses these without an importance matrix.
NEEDS_IMATRIX = {"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "q2_k_s"}  # llama.cpp refuses these without one

# Main tensor type of each llama.cpp file type, for size estimates only.
_MAIN_TYPE: dict[str, Q] = {
    "q4_0": Q.Q4_0,
    "q4_1": Q.Q4_1,
    "q5_0": Q.Q5_0,
    "q5_1": Q.Q5_1,
    "q2_k": Q.Q2_K,
    "q2_k_s": Q.Q2_K,
    "q3_k_s": Q.Q3_K,
    "q3_k_m": Q.Q3_K,
    "q3_k_l": Q.Q4_K,
    "q4_k_s": Q.Q4_K,
    "q4_k_m": Q.Q4_K,
    "q5_k_s": Q.Q5_K,
    "q5_k_m": Q.Q5_K,
    "q6_k": Q.Q6_K,
    "iq1_s": Q.IQ1_S,
    "iq1_m": Q.IQ1_M,
    "iq2_xxs": Q.IQ2_XXS,
    "iq2_xs": Q.IQ2_XS,
    "iq2_s": Q.IQ2_S,
    "iq2_m": Q.IQ2_S,
    "iq3_xxs": Q.IQ3_XXS,
    "iq3_xs": Q.IQ3_S,
    "iq3_s": Q.IQ3_S,
    "iq3_m": Q.IQ3_S,
    "iq4_nl": Q.IQ4_NL,
    "iq4_xs": Q.IQ4_XS,
    "tq1_0": Q.TQ1_0,
    "tq2_0": Q.TQ2_0,
}


def all_outtypes() -> list[str]:
    """Every accepted --outtype value."""
    return ["auto", *DIRECT, *LLAMA_CPP]


def normalize(outtype: str) -> str:
    """Lower-case, resolve aliases, and reject unknown names."""
    name = ALIASES.get(outtype.lower(), outtype.lower())
    if name not in DIRECT and name not in LLAMA_CPP and name != "auto":
        raise ConvertError(
            f"unknown output type {outtype!r}",
            f"choose one of: {', '.join(all_outtypes())}",
        )
    return name


def auto_type(source_dtypes: set[str]) -> str:
    """--outtype auto: keep a 16-bit source's precision (BF16 or F16); F32 sources become F16."""
    return "bf16" if "BF16" in source_dtypes else "f16"


# Name endings of the tensors llama.cpp's converter and quantizer keep in F32 (routers).
_F32_ENDINGS = tuple(
    "." + gguf.TENSOR_NAMES[t].rsplit(".", 1)[-1] + ".weight"
    for t in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP)
)

# A text model's own tensors that llama.cpp's converter keeps in F32 (not a projector's v.*).
_F32_NAMES = frozenset(gguf.TENSOR_NAMES[t] + ".weight" for t in (gguf.MODEL_TENSOR.POS_EMBD, gguf.MODEL_TENSOR.TOKEN_TYPES))


def tensor_type(name: str, shape: tuple[int, ...], outtype: Q) -> Q:
    """The GGUF type of one tensor for a directly written output type (as llama.cpp chooses)."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32  # norms, biases, rope factors: small and sensitive
    if name.endswith(_F32_ENDINGS) or name in _F32_NAMES:
        return Q.F32  # routers, an encoder's position and token-type embeddings, whatever the output type
    if outtype == Q.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] != 0:
        return Q.F16  # rows that do not fill whole blocks
    return outtype


def nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    """Bytes of a tensor of this shape (numpy order) stored as qtype."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block * size


def estimate_quantized(n_params_2d: int, n_other_bytes: int, outtype: str) -> int:
    """A rough size of a llama.cpp-quantized file (for the disk-space check and dry runs)."""
    block, size = gguf.GGML_QUANT_SIZES[_MAIN_TYPE[outtype]]
    return int(n_params_2d * size / block * 1.1) + n_other_bytes


def to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    """Source storage (F32, F16, BF16-as-uint16) to float32."""
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


# Elements per step of the F16 encoders: their temporaries (numpy's intp indices) stay in cache.
_CHUNK = 1 << 16


@functools.cache
def _bf16_to_f16_table() -> np.ndarray:
    """The F16 of every BF16 bit pattern, made by numpy's own float32 -> float16 cast."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32).astype(np.float16)


def bf16_to_f16(a: np.ndarray) -> np.ndarray:
    """BF16 (as uint16) to float16 by table look-up: the bytes of the float32 cast, in one pass."""
    table = _bf16_to_f16_table()
    flat = np.ascontiguousarray(a).reshape(-1)
    out = np.empty(flat.shape, np.float16)
    for i in range(0, flat.size, _CHUNK):
        np.take(table, flat[i : i + _CHUNK], out=out[i : i + _CHUNK], mode="wrap")
    return out.reshape(a.shape)


def f32_to_f16(a: np.ndarray) -> np.ndarray:
    """float32 to float16; values that are BF16 numbers (converted BF16 rows) go by table."""
    flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape, np.float16)
    if sys.byteorder != "little":
        out[:] = flat
        return out.reshape(a.shape)
    bits, table = flat.view(np.uint32), _bf16_to_f16_table()
    tmp = np.empty(min(_CHUNK, flat.size), np.uint32)
    for i in range(0, flat.size, _CHUNK):
        chunk, t = bits[i : i + _CHUNK], tmp[: min(_CHUNK, flat.size - i)]
        np.bitwise_and(chunk, 0xFFFF, out=t)
        if t.any():  # not BF16 numbers (an F32 source): numpy's cast for the rest
            out[i:] = flat[i:]
            break
        np.right_shift(chunk, 16, out=t)
        np.take(table, t, out=out[i : i + _CHUNK], mode="wrap")
    return out.reshape(a.shape)


def encode(a: np.ndarray, dtype: str, qtype: Q, converted: bool = False) -> np.ndarray:
    """A block of rows in source storage (or float32 if converted) as the bytes of qtype."""
    src = "F32" if converted else dtype
    if qtype == Q.F32:
        return to_f32(a, src)
    if qtype == Q.F16:
        if src == "F16":
            return a
        return bf16_to_f16(a) if src == "BF16" else f32_to_f16(to_f32(a, src))
    if qtype == Q.BF16 and src == "BF16":
        return a
    assert a.dtype == DTYPES[src]
    return gguf.quants.quantize(to_f32(a, src), qtype)
