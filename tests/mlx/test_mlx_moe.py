"""Mixture-of-experts families on MLX: a random Hugging Face checkpoint of each, built here with
transformers and a real tokenizer, converts with `localrun convert --to mlx`, computes the logits
transformers computes at every position, and runs in localrun's MLX engine with the same greedy
continuation. The routing is varied enough that a wrong expert order or router would show."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from localrun import api
from localrun.generation import Request
from localrun.settings import GenerationParams

from ..conftest import ASSETS, assets_or_skip
from ..convert.convert_helpers import assert_logits_close
from .conftest import collect

TEXT = "The quick brown fox jumps over the lazy dog. 12345 + 67.89 = ? Once upon a time, there was"
N_EXPERTS, TOP_K = 8, 2
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _configs() -> dict[str, Callable[..., Any]]:
    import transformers as tf

    moe = dict(num_experts_per_tok=TOP_K)
    return {
        "mixtral": lambda **kw: tf.MixtralConfig(**COMMON, **kw, **moe, num_local_experts=N_EXPERTS,
                                                 sliding_window=None),
        "qwen2_moe": lambda **kw: tf.Qwen2MoeConfig(**COMMON, **kw, **moe, num_experts=N_EXPERTS,
                                                    moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                                    norm_topk_prob=False),
        "qwen3_moe": lambda **kw: tf.Qwen3MoeConfig(**COMMON, **kw, **moe, num_experts=N_EXPERTS,
                                                    moe_intermediate_size=32, head_dim=16, norm_topk_prob=True),
        "olmoe": lambda **kw: tf.OlmoeConfig(**COMMON, **kw, **moe, num_experts=N_EXPERTS, norm_topk_prob=False),
        "granitemoe": lambda **kw: tf.GraniteMoeConfig(**COMMON, **kw, **moe, num_local_experts=N_EXPERTS,
                                                       embedding_multiplier=3.0, residual_multiplier=0.5,
                                                       attention_multiplier=0.2, logits_scaling=0.5),
        "gpt_oss": lambda **kw: tf.GptOssConfig(**COMMON, **kw, **moe, num_local_experts=N_EXPERTS, head_dim=16,
                                                sliding_window=4,
                                                layer_types=["sliding_attention", "full_attention"],
                                                # mlx-lm's yarn always rounds the correction range;
                                                # the published config's truncate=False would differ
                                                # from transformers by ~1e-3 of the logits' span.
                                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                                 "factor": 32.0, "beta_fast": 32.0,
                                                                 "beta_slow": 1.0, "truncate": True,
                                                                 "original_max_position_embeddings": 4096}),
    }


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"]


def _randomize(model: Any, seed: int) -> None:
    """Random weights everywhere (norms around 1); a sharp output layer, so greedy choices are clear."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + (torch.rand(p.shape, generator=g) - 0.5) * 0.6)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 4.0 / p.shape[-1] ** 0.5)
            elif name.endswith(("gate.weight", "router.weight")) and p.shape[0] == N_EXPERTS:
                p.copy_(torch.randn(p.shape, generator=g) * 3.0 / p.shape[-1] ** 0.5)  # decisive routing
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(assets_or_skip(ASSETS / "tokenizers" / "qwen3")))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Callable[[str], tuple[Path, Any]]:
    import torch
    import transformers as tf

    built: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"moe-{family}")
            config = _configs()[family](vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                        eos_token_id=tokenizer.eos_token_id)
            config._attn_implementation = "eager"
            torch.manual_seed(0)
            model = tf.AutoModelForCausalLM.from_config(config)
            _randomize(model, seed=FAMILIES.index(family))
            model.eval()
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            built[family] = (folder, model)
        return built[family]

    return get


def _ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(TEXT, add_special_tokens=False))


def _routing(model: Any, ids: list[int]) -> list[list[frozenset[int]]]:
    """The experts each layer picks at each position (from the model's own router logits)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_router_logits=True)
    return [[frozenset(row.topk(TOP_K).indices.tolist()) for row in layer.reshape(len(ids), -1)]
            for layer in out.router_logits]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_converts_to_mlx_computes_like_transformers_and_runs(
    family: str, checkpoints: Callable[[str], tuple[Path, Any]], tokenizer: Any, cli: Any, tmp_path: Path
) -> None:
    import mlx.core as mx
    import torch
    from mlx_lm import load

    folder, model = checkpoints(family)
    ids = _ids(tokenizer)
    routes = _routing(model, ids)
    assert len(routes) == 2  # one per layer
    for layer in routes:  # a third of the positions or more leave the most common expert set
        common = max(set(layer), key=layer.count)
        assert sum(r != common for r in layer) >= len(layer) / 3, f"routing too uniform: {layer}"
        assert len(set().union(*layer)) >= N_EXPERTS // 2  # most experts are used somewhere

    out = tmp_path / "mlx"
    res = cli("convert", str(folder), "--to", "mlx", "-o", str(out), "--name", f"tiny-{family}:mlx")
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == family

    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().numpy()
    mlx_model, _ = load(str(out))
    got = np.array(mlx_model(mx.array([ids]))[0].astype(mx.float32))
    assert_logits_close(got, ref)

    n = 12
    with torch.no_grad():
        expected_ids = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    session = api.load(f"tiny-{family}:mlx", engine="mlx")
    try:
        text, final, _ = collect(session, Request.raw(TEXT), GenerationParams(temperature=0, max_tokens=n))
    finally:
        session.close()
    assert final.finish_reason == "length"
    assert text == tokenizer.decode(expected_ids)
