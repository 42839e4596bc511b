"""A tiny random Llama in Hugging Face layout with a real tokenizer, and PEFT LoRA adapters on it.

Shared by the LoRA tests of the engines, the CLI and the server. The weights are random but
"peaked" (unit-scale tied embeddings dominate the residual stream), so greedy decoding has clear
winners; the adapters' B matrices are random and non-zero, so each adapter changes the output.
"""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ASSETS, assets_or_skip

TOKENIZER = ASSETS / "tokenizers" / "llama2-spm"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_base(folder: Path, seed: int = 0) -> Path:
    """config.json, model.safetensors (F32) and the tokenizer of a 2-layer Llama."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(assets_or_skip(TOKENIZER)))
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                            rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + (torch.rand(p.shape, generator=g) - 0.5) * 0.6)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))
    model.eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_adapter(base: Path, folder: Path, seed: int, r: int = 4, alpha: float = 8.0, **config: object) -> Path:
    """A PEFT LoRA on every attention and MLP projection, with random non-zero A and B."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    model = tf.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS,
                                                  init_lora_weights=False, **config))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(str(folder))
    return folder
