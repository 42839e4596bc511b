"""Mixtral: the Llama graph in llama.cpp with a sparse MoE block (w1/w3/w2 experts, top-k router)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import gguf

from convert.archs import register
from convert.archs.base import MoeArch
from convert.archs.llama import Llama


@register("MixtralForCausalLM")
class Mixtral(MoeArch, Llama):
    expert_projs: ClassVar[Mapping[str, gguf.MODEL_TENSOR]] = {
        "w1": gguf.MODEL_TENSOR.FFN_GATE_EXP,
        "w3": gguf.MODEL_TENSOR.FFN_UP_EXP,
        "w2": gguf.MODEL_TENSOR.FFN_DOWN_EXP,
    }
