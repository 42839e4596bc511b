"""A tiny random Qwen3 that can think: the real Qwen3 tokenizer and chat template, random weights,
converted to GGUF with localrun's converter.

Shared by the thinking tests of the engine loop, the CLI and the server. The weights are random,
so what the model says is driven by each test (a grammar at the engine level, or a prompt that
opens the thought).
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ASSETS, assets_or_skip

TOKENIZER = ASSETS / "tokenizers" / "qwen3"
TEMPLATE = ASSETS / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"
# DeepSeek-R1's distills open <think> in the prompt: a random model's reply is all thought until </think>.
R1_TEMPLATE = ASSETS / "chat-templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"


def make_thinker(folder: Path, seed: int = 0, template: Path = TEMPLATE) -> Path:
    """A 2-layer Qwen3 (hidden 64) with the Qwen3 tokenizer and a thinking template (Qwen3's by
    default), as an F32 GGUF; returns its path."""
    import torch
    import transformers as tf

    from localrun import api

    ckpt = folder / f"tiny-{template.stem}"
    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(TOKENIZER)))
    tok.chat_template = assets_or_skip(template).read_text()
    config = tf.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, vocab_size=len(tok), max_position_embeddings=2048,
                            rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    model.eval()
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    out = folder / f"tiny-{template.stem}.gguf"
    api.convert_checkpoint(ckpt, out, outtype="f32")
    return out
