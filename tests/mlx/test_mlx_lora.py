"""PEFT LoRA folders on the MLX engine: greedy text equals PEFT's in transformers, alone, together
and scaled; adapters MLX cannot apply fail with a hint; per-request adapters are refused."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.errors import BackendUnavailableError, LocalrunError, UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo, Store

from ..convert.convert_helpers import need_asset, randomize
from .conftest import collect

PROMPT = "Once upon a time there was a"
N = 24
GREEDY = GenerationParams(temperature=0, max_tokens=N)
ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Adapters:
    base: Path  # a tiny random Llama in Hugging Face layout, with the Llama 2 tokenizer
    a: Path  # attention and MLP, with per-module ranks and alphas
    b: Path  # rsLoRA on some projections of the last layer only
    dora: Path
    ia3: Path


def tiny_llama(folder: Path) -> Any:
    """A random two-layer Llama with the Llama 2 tokenizer, saved in Hugging Face layout."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(need_asset("tokenizers", "llama2-spm")))
    # A rope theta other than the default: transformers 5 saves it inside rope_parameters, where
    # mlx-lm does not look (the engine passes it on; the base's text equals transformers' then).
    config = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    randomize(model)
    model.eval().save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Adapters:
    import peft
    import torch

    root = tmp_path_factory.mktemp("lora")
    model = tiny_llama(root / "tiny-llama")

    def save(name: str, config: Any) -> Path:
        torch.manual_seed(len(name))
        peft.get_peft_model(copy.deepcopy(model), config).save_pretrained(str(root / name))
        return root / name

    # init_lora_weights=False: B is random too, so every adapter changes the output.
    return Adapters(
        base=root / "tiny-llama",
        a=save("a", peft.LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_MLP, init_lora_weights=False,
                                    rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3})),
        b=save("bb", peft.LoraConfig(r=3, lora_alpha=2, use_rslora=True, target_modules=["q_proj", "up_proj", "o_proj"],
                                     layers_to_transform=[1], init_lora_weights=False)),
        dora=save("dora", peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False)),
        ia3=save("ia3", peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])),
    )


def _info(path: Path) -> ModelInfo:
    return Store(path.parent / ".store").get(str(path))


def _in_process(adapters: Adapters, lora: Sequence[tuple[Path, float]]) -> Any:
    from localrun.backends.loop import InProcess
    from localrun.backends.mlx import MLXBackend

    options = LoadOptions(n_ctx=128, lora=tuple((str(p), s) for p, s in lora))
    return InProcess(MLXBackend().load(_info(adapters.base), options))


def mlx_text(adapters: Adapters, lora: Sequence[tuple[Path, float]]) -> str:
    session = _in_process(adapters, lora)
    try:
        text, last, _ = collect(session, Request.raw(PROMPT), GREEDY)
    finally:
        session.close()
    assert last.completion_tokens == N and last.finish_reason == "length"
    return text


def peft_text(adapters: Adapters, lora: Sequence[tuple[Path, float]]) -> str:
    """PEFT's greedy continuation with these adapters active together, each scaled by its scale."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(adapters.base))
    model: Any = AutoModelForCausalLM.from_pretrained(str(adapters.base)).eval()
    names = [f"a{i}" for i in range(len(lora))]
    if lora:
        model = PeftModel.from_pretrained(model, str(lora[0][0]), adapter_name=names[0])
        for name, (path, _) in zip(names[1:], lora[1:], strict=True):
            model.load_adapter(str(path), adapter_name=name)
        model.base_model.set_adapter(names)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for name, (_, scale) in zip(names, lora, strict=True):
                    if name in module.scaling:
                        module.scaling[name] *= scale
    ids = tok.encode(PROMPT)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    new = out[0, len(ids):].tolist()
    assert len(new) == N
    head = tok.decode(ids, skip_special_tokens=True)
    full = tok.decode(ids + new, skip_special_tokens=True)
    return full[len(head):]


@pytest.fixture
def worker(adapters: Adapters) -> Iterator[Any]:
    """Adapter a on the MLX engine in its worker process, as the CLI and the server load it."""
    session = api.load(_info(adapters.base), LoadOptions(n_ctx=128, lora=((str(adapters.a), 1.0),)), engine="mlx")
    yield session
    session.close()


def test_peft_adapter_on_mlx_equals_peft(adapters: Adapters, worker: Any) -> None:
    text, last, _ = collect(worker, Request.raw(PROMPT), GREEDY)
    assert last.completion_tokens == N and last.finish_reason == "length"
    assert text == peft_text(adapters, [(adapters.a, 1.0)])
    assert mlx_text(adapters, []) == peft_text(adapters, []) != text, "the adapter must change the output"
    assert worker.info()["lora"] == [{"path": str(adapters.a), "scale": 1.0}]
    with pytest.raises(UsageError, match="when the model loads") as e:
        collect(worker, Request.raw(PROMPT), GenerationParams(max_tokens=2, lora=(("style.gguf", 1.0),)))
    assert "--lora" in (e.value.hint or "")


def test_two_adapters_and_scales_equal_peft(adapters: Adapters) -> None:
    both = [(adapters.a, 1.0), (adapters.b, 1.0)]
    together = mlx_text(adapters, both)
    assert together == peft_text(adapters, both)
    half = [(adapters.a, 0.5)]
    halved = mlx_text(adapters, half)
    assert halved == peft_text(adapters, half)
    assert len({together, halved, peft_text(adapters, [(adapters.a, 1.0)])}) == 3, "b and the scale must matter"


def test_second_load_reuses_the_converted_adapter(adapters: Adapters, monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun.backends import mlx_adapters

    lora = [(adapters.a, 0.5), (adapters.b, 2.0)]
    first = mlx_text(adapters, lora)
    (folder,) = mlx_adapters.cache_dir().iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapters.safetensors"]

    def no_work(*_: Any) -> Any:
        raise AssertionError("the adapters were converted again")

    monkeypatch.setattr(mlx_adapters, "combine", no_work)
    assert mlx_text(adapters, lora) == first
    with pytest.raises(AssertionError, match="converted again"):
        mlx_text(adapters, [(adapters.a, 0.25)])  # another scale is another adapter


def test_per_request_adapters_are_refused_by_the_engine(adapters: Adapters) -> None:
    session = _in_process(adapters, [])
    try:
        with pytest.raises(UsageError, match="MLX engine applies LoRA adapters when the model loads") as e:
            session.engine.start(0, [1, 2, 3], GenerationParams(lora=(("style.gguf", 1.0),)), 0, 0, 0)
        assert "--engine mlx --lora" in (e.value.hint or "") and "llama.cpp" in (e.value.hint or "")
        text, last, _ = collect(session, Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=3))
        assert last.completion_tokens == 3 and text
    finally:
        session.close()


def _edited(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.mark.parametrize(("kind", "match"), [
    ("dora", "uses DoRA"),
    ("ia3", "of type IA3"),
    ("modules_to_save", "uses modules_to_save"),
    ("fan_in_fan_out", "uses fan_in_fan_out"),
])
def test_adapters_mlx_cannot_apply_fail_with_a_hint(adapters: Adapters, tmp_path: Path, kind: str, match: str) -> None:
    from localrun.backends.mlx_adapters import to_mlx_adapter

    folder = getattr(adapters, kind, None)
    if folder is None:
        folder = _edited(adapters.a, tmp_path / kind, **{kind: ["lm_head"] if kind == "modules_to_save" else True})
    with pytest.raises(BackendUnavailableError, match=match) as e:
        to_mlx_adapter([(str(folder), 1.0)], tmp_path / "out")
    assert str(folder) in e.value.message and "\n" not in e.value.message
    assert f"localrun convert BASE_DIR --lora {folder}'" in (e.value.hint or "")
    assert not (tmp_path / "out").exists()


def test_modules_outside_the_layers_fail_with_a_hint(adapters: Adapters, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    from localrun.backends.mlx_adapters import to_mlx_adapter

    folder = tmp_path / "head"
    shutil.copytree(adapters.a, folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    weights["base_model.model.lm_head.lora_A.weight"] = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    weights["base_model.model.lm_head.lora_B.weight"] = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(weights, str(folder / "adapter_model.safetensors"))
    with pytest.raises(BackendUnavailableError, match="'lm_head', outside the decoder layers") as e:
        to_mlx_adapter([(str(folder), 1.0)], tmp_path / "out")
    assert f"'localrun convert {folder}' then '--lora NAME'" in (e.value.hint or "")


def test_unsupported_adapter_fails_the_load_in_the_worker(adapters: Adapters) -> None:
    """The error crosses the worker process as itself, and no half-converted folder stays."""
    from localrun.backends.mlx_adapters import cache_dir

    with pytest.raises(LocalrunError, match="DoRA") as e:
        api.load(_info(adapters.base), LoadOptions(n_ctx=128, lora=((str(adapters.dora), 1.0),)), engine="mlx")
    assert isinstance(e.value, BackendUnavailableError) and e.value.hint
    assert not cache_dir().exists() or not any(cache_dir().iterdir())


def test_modules_the_model_lacks_fail_the_load_with_a_hint(adapters: Adapters, tmp_path: Path) -> None:
    """Layer modules that mlx-lm's model does not have (another base, other names) are named."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "renamed"
    shutil.copytree(adapters.a, folder)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "qkv_proj"): v for k, v in weights.items()}, str(folder / "adapter_model.safetensors"))
    with pytest.raises(BackendUnavailableError, match=r"on MLX: model\.layers\.\d\.self_attn\.qkv_proj\.lora_[ab]: not an") as e:
        _in_process(adapters, [(folder, 1.0)])
    assert "tiny-llama" in e.value.message and "\n" not in e.value.message
    assert f"'localrun convert {folder}' then '--lora NAME'" in (e.value.hint or "")
