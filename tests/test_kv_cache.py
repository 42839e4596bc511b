"""The KV cache's type (--kv-type): llama.cpp allocates the cache of that type and size, the
starter answers on it, a quantized cache without flash attention is refused, and the default
context and eval follow the type."""

from __future__ import annotations

from pathlib import Path

import pytest

from localrun import api
from localrun.backends.mlx import MLXBackend
from localrun.cli import build_parser
from localrun.cli.options import load_options_from_args
from localrun.errors import UsageError
from localrun.fit import Shape, choose_context, kv_cache_bytes, shape_of
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo
from localrun.workbench.perplexity import evaluate

MODEL = "smollm2:135m"
MIB = 1 << 20


@pytest.mark.parametrize(("kv_type", "parallel"), [("f16", 1), ("q8_0", 2), ("q4_0", 1)])
def test_the_cache_has_the_type_and_size_asked_for(kv_type: str, parallel: int) -> None:
    session = api.load(MODEL, LoadOptions(n_ctx=512, n_parallel=parallel, kv_type=kv_type))
    try:
        info = session.info()
        # llama.cpp's own report of the cache it allocated (MiB with two decimals)
        assert [(c["k_type"], c["v_type"], c["cells"], c["streams"]) for c in info["kv_cache"]] == \
            [(kv_type, kv_type, 512, parallel)]
        expected = kv_cache_bytes(shape_of(api.get_model(MODEL)), 512 * parallel, kv_type)
        (cache,) = info["kv_cache"]
        for mib in (cache["k_mib"], cache["v_mib"]):  # K and V take half each; llama.cpp rounds to 0.01 MiB
            assert abs(mib * MIB - expected / 2) <= 0.005 * MIB + 1
        assert info["kv_bytes"] == round((cache["k_mib"] + cache["v_mib"]) * MIB)
        assert info["kv_type"] == kv_type and info["n_parallel"] == parallel
        request = api.build_messages("What is the opposite of hot?")
        text = "".join(c.text for c in api.stream(session, request, GenerationParams(temperature=0, max_tokens=8)))
        assert "cold" in text.lower()
    finally:
        session.close()


def test_a_quantized_cache_the_engine_cannot_hold_is_a_clear_error(cli, stories: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UsageError, match="--kv-type q4_0 needs flash attention, and --flash-attn is off"):
        LoadOptions(kv_type="q4_0", flash_attn=False)
    with pytest.raises(UsageError, match="invalid value for --kv-type: 'q5_1'"):
        LoadOptions(kv_type="q5_1")
    out = cli("run", MODEL, "hi", "--kv-type", "q4_0", "--flash-attn", "off", "-n", "4")
    assert out.returncode != 0 and out.stdout == ""
    assert "--kv-type q4_0 needs flash attention, and --flash-attn is off" in out.stderr
    assert "drop --flash-attn off" in out.stderr
    # stories260K's heads have 8 values, which 32-value blocks cannot cover
    with pytest.raises(UsageError, match="--kv-type q8_0 cannot hold the KV cache of .* does not divide n_embd_head_k=8"):
        api.load(str(stories), LoadOptions(n_ctx=256, kv_type="q8_0"))


def test_every_command_that_loads_takes_kv_type() -> None:
    parser = build_parser()
    for argv in (["run", MODEL, "hi"], ["batch", MODEL, "-i", "in.jsonl", "-o", "out.jsonl"], ["tui"], ["serve"]):
        args = parser.parse_args([*argv, "--kv-type", "q8_0"])
        assert load_options_from_args(args).kv_type == "q8_0", argv
    assert parser.parse_args(["eval", MODEL, "--text", "t.txt", "--kv-type", "q4_0"]).kv_type == "q4_0"
    assert load_options_from_args(parser.parse_args(["run", MODEL, "hi"])).kv_type == "f16"


def test_the_mlx_engine_refuses_a_quantized_cache() -> None:
    # mlx-lm's BatchGenerator cannot batch a QuantizedKVCache; the refusal comes before any loading
    model = ModelInfo("tiny-mlx", "/models/tiny-mlx", "mlx", "path", 1)
    with pytest.raises(UsageError) as e:
        MLXBackend().load(model, LoadOptions(kv_type="q8_0"))
    assert "--kv-type q8_0: the MLX engine keeps an f16 KV cache only" in e.value.message
    assert "drop --kv-type" in (e.value.hint or "")


def test_the_default_context_counts_the_cache_type() -> None:
    shape = Shape(layers=32, kv_heads=8, key_dim=128, value_dim=128, context_length=131072)
    weights = 4 << 30
    # The same memory holds a longer context in a smaller cache.
    f16, q8, q4 = (choose_context(shape, weights, memory=16 << 30, kv_type=t).tokens for t in ("f16", "q8_0", "q4_0"))
    assert 4096 < f16 < q8 < q4 < 131072
    assert kv_cache_bytes(shape, 1024, "q4_0") == 32 * 1024 * 8 * 256 * 18 // 32


def test_eval_scores_with_the_cache_type(starter: Path, tmp_path: Path) -> None:
    from pydoc_data.topics import topics

    text = tmp_path / "topics.txt"
    text.write_text("\n\n".join(topics[k] for k in sorted(topics))[:2000], encoding="utf-8")
    f16, q4 = (evaluate(starter, text, n_ctx=128, chunks=1, threads=2, kv_type=t) for t in ("f16", "q4_0"))
    assert (f16.kv_type, q4.kv_type) == ("f16", "q4_0") and f16.tokens == q4.tokens
    # a 4-bit cache moves the scores a little, not a lot
    assert f16.ppl != q4.ppl and abs(q4.ppl / f16.ppl - 1) < 0.2
