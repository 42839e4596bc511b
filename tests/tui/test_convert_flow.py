"""The Convert screen converts a real checkpoint folder and the result appears in the Library."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ASSETS, assets_or_skip
from tests.tui.helpers import wait_for
from tui.screens.convert import ConvertScreen
from tui.screens.library import LibraryScreen

pytestmark = pytest.mark.slow


def tiny_llama(folder: Path) -> Path:
    """A random 2-layer Llama in Hugging Face layout with the real Llama 2 tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(assets_or_skip(ASSETS / "tokenizers" / "llama2-spm")))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def test_convert_screen_converts_and_registers(make_app: Any, tmp_path: Path) -> None:
    asyncio.run(_convert_flow(make_app, tmp_path))
    from localrun import api

    model = api.get_model("tiny:q8")
    assert model.quantization == "Q8_0" and model.architecture == "llama" and Path(model.path).exists()


async def _convert_flow(make_app: Any, tmp_path: Path) -> None:
    src = tiny_llama(tmp_path / "tiny-llama")
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConvertScreen), "the convert screen")
        screen = pilot.app.screen
        screen.query_one("#convert-src").value = str(src)
        screen.query_one("#convert-type").value = "q8_0"
        screen.query_one("#convert-name").value = "tiny:q8"
        await pilot.press("ctrl+g")
        status = screen.query_one("#convert-status")
        await wait_for(pilot, lambda: "Done" in str(status.render()) or "Failed" in str(status.render()),
                       "the conversion to finish")
        assert "Done: tiny:q8" in str(status.render()), str(status.render())
        await pilot.press("f2")
        lib = pilot.app.mode_screens["library"]
        assert isinstance(lib, LibraryScreen)
        await pilot.press("r")
        await wait_for(pilot, lambda: lib.loaded and "tiny:q8" in lib.row_names(), "the model in the library")
