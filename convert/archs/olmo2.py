"""OLMo 2: norms after attention and after the MLP (none before), Q/K RMS norms over the whole
projection; gguf-py's tensor map names them all, and llama.cpp uses NEOX rope (no permutation)."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import Arch


@register("Olmo2ForCausalLM")
class Olmo2(Arch):
    gguf_arch = gguf.MODEL_ARCH.OLMO2
    output_required = True  # llama.cpp's OLMo 2 requires an output matrix, even when tied
