"""SmolLM3: the Llama graph with rope left out of every fourth layer (`no_rope_layers`)."""

from __future__ import annotations

from typing import Any

import gguf

from convert.archs import register
from convert.archs.llama import Llama
from convert.errors import ConvertError

# llama.cpp's SmolLM3 graph has no key for the layers without rope: it skips rope in every
# fourth layer, which is transformers' default (no_rope_layer_interval = 4).
LLAMA_CPP_NO_ROPE_INTERVAL = 4


@register("SmolLM3ForCausalLM")
class SmolLM3(Llama):
    gguf_arch = gguf.MODEL_ARCH.SMOLLM3

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self._check_rope_layers()
        if self.get("use_sliding_window") and "sliding_attention" in self.get("layer_types", []):
            raise ConvertError(
                "SmolLM3 with sliding-window layers is not supported",
                "llama.cpp's SmolLM3 attends to the whole context in every layer",
            )

    def _check_rope_layers(self) -> None:
        step = LLAMA_CPP_NO_ROPE_INTERVAL
        supported = [int((i + 1) % step != 0) for i in range(self.n_layers)]
        interval = int(self.get("no_rope_layer_interval", step))
        wanted = self.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(self.n_layers)
        ]
        if [int(bool(x)) for x in wanted] != supported:
            raise ConvertError(
                f"SmolLM3 layers with rope {list(wanted)} are not supported",
                f"llama.cpp leaves rope out of every {step}th layer only: {supported}",
            )
