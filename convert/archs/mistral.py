"""Mistral (7B v0.1-v0.3, Nemo): the Llama graph in llama.cpp, same tensor layout."""

from __future__ import annotations

from convert.archs import register
from convert.archs.llama import Llama


@register("MistralForCausalLM")
class Mistral(Llama):
    pass
