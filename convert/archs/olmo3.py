"""OLMo 3: OLMo 2 with sliding-window attention (llama.cpp's OLMO2 graph)."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.olmo2 import Olmo2
from convert.errors import ConvertError


@register("Olmo3ForCausalLM")
class Olmo3(Olmo2):
    """OLMo 2 with sliding-window attention on the layers layer_types names (three of four
    by default). llama.cpp gives the sliding layers plain rope at the full layers' base, without
    the full layers' yarn, as transformers does with its default sliding rope."""

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        window = self.get("sliding_window")
        if not window:
            return
        types = self.get("layer_types") or [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(self.n_layers)
        ]
        if len(types) != self.n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ConvertError(
                f"config.json's layer_types ({len(types)} entries) do not name sliding or full "
                f"attention for each of the {self.n_layers} layers",
                "the config does not match the checkpoint",
            )
        w.add_sliding_window(int(window))
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        sliding, full = self.rope("sliding_attention"), self.rope("full_attention")
        if (sliding.get("rope_type") or "default") != "default" or sliding.get("rope_theta") != full.get(
            "rope_theta"
        ):
            raise ConvertError(
                "the sliding-window layers' rope differs from plain rope at the full layers' base "
                f"({sliding}), which llama.cpp's OLMo 3 graph cannot express",
                "only OLMo 3's published rope settings convert",
            )
