"""Mixture-of-experts models at run time: --cpu-moe keeps the expert tensors of the first N layers
in host memory (llama.cpp's tensor buffer-type overrides), `show` and `pull --check` count experts
and active parameters, and the fit estimate places expert bytes in RAM.

The model is a tiny random Qwen3-MoE (2 layers, 4 experts, 2 per token, the real Qwen3 tokenizer)
converted by llama.cpp's own convert_hf_to_gguf.py, so that the file is what llama.cpp expects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from localrun import api
from localrun.errors import UsageError
from localrun.generation import Request
from localrun.gguf_header import Experts, experts_of, model_experts, read_gguf
from localrun.settings import GenerationParams, LoadOptions
from localrun.units import count as human_count
from tests.convert.convert_helpers import (
    convert_reference,
    converter_cache,
    llama_cpp_converter_dir,
    need_asset,
    randomize,
)

NAME = "tiny-moe:f32"
PROMPT = "Once upon a time"
GREEDY = ["--raw", "--temperature", "0", "-n", "12", "--ctx", "256"]
EXPERTS = ("ffn_down_exps", "ffn_gate_exps", "ffn_up_exps")


@dataclass(frozen=True)
class MoeFile:
    path: Path
    parameters: int  # counted on the transformers model
    expert_elements: int  # the experts' parameters, counted there too


@pytest.fixture(scope="session")
def moe_file(tmp_path_factory: pytest.TempPathFactory) -> MoeFile:
    """A 2-layer Qwen3-MoE with 4 experts (2 per token), random weights, as an F32 GGUF."""
    import torch
    import transformers as tf

    root = tmp_path_factory.mktemp("moe")
    tok = tf.AutoTokenizer.from_pretrained(str(need_asset("tokenizers", "qwen3")))
    config = tf.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tok),
        max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config)
    randomize(model, seed=0, peaked=True)  # clear greedy winners, so no near-tie decides a token
    folder = root / "ckpt"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    out = root / "tiny-moe-F32.gguf"
    convert_reference(llama_cpp_converter_dir(converter_cache()), folder, out, "f32")
    return MoeFile(out, sum(p.numel() for p in model.parameters()),
                   sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name))


@pytest.fixture
def moe_gguf(moe_file: MoeFile) -> Path:
    return moe_file.path


@pytest.fixture
def moe(moe_file: MoeFile) -> MoeFile:
    """The MoE GGUF registered in this test's store."""
    api.add_model(moe_file.path, name=NAME)
    return moe_file


def _reply(options: LoadOptions) -> tuple[str, dict]:
    session = api.load(NAME, options)
    try:
        text = "".join(c.text for c in session.stream(Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=12)))
        return text, session.info()
    finally:
        session.close()


def test_cpu_moe_keeps_the_greedy_tokens_and_llama_cpp_places_the_expert_tensors(moe: MoeFile, cli) -> None:  # noqa: ANN001
    plain = cli("run", NAME, PROMPT, *GREEDY)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip()
    for n in ("1", "all"):
        res = cli("run", NAME, PROMPT, *GREEDY, "--cpu-moe", n)
        assert res.returncode == 0, res.stderr
        assert res.stdout == plain.stdout, n

    # What llama.cpp's loader logged as overridden: layer 0's experts, then every layer's.
    text, info = _reply(LoadOptions(n_ctx=256, cpu_moe=1))
    assert sorted(info["host_tensors"]) == [f"blk.0.{e}.weight" for e in EXPERTS]
    assert info["cpu_moe_layers"] == 1
    assert text == plain.stdout.rstrip("\n")
    text, info = _reply(LoadOptions(n_ctx=256, cpu_moe="all"))
    assert sorted(info["host_tensors"]) == [f"blk.{i}.{e}.weight" for i in (0, 1) for e in EXPERTS]
    assert info["cpu_moe_layers"] == 2
    assert text == plain.stdout.rstrip("\n")
    _, info = _reply(LoadOptions(n_ctx=256))
    assert info["host_tensors"] == [] and info["cpu_moe_layers"] == 0


def test_cpu_moe_errors_name_the_problem(moe: MoeFile, stories: Path, cli) -> None:  # noqa: ANN001
    api.add_model(stories, name="stories:f32")
    dense = cli("run", "stories:f32", PROMPT, *GREEDY, "--cpu-moe", "1")
    assert dense.returncode == 2
    assert "'stories:f32' is not a mixture-of-experts model" in dense.stderr and "drop --cpu-moe" in dense.stderr
    assert "Traceback" not in dense.stderr
    for bad in ("-1", "some"):
        res = cli("run", NAME, PROMPT, "--cpu-moe", bad)
        assert res.returncode == 2 and "--cpu-moe" in res.stderr and "expected 'all' or a number" in res.stderr
    with pytest.raises(UsageError, match="--cpu-moe"):
        LoadOptions(cpu_moe=-2)
    with pytest.raises(UsageError, match="--cpu-moe"):
        LoadOptions(cpu_moe="half")
    # JSON carries the option to the engine process and back unchanged.
    assert LoadOptions(**json.loads(json.dumps(LoadOptions(cpu_moe="all").to_dict()))).cpu_moe == "all"


def test_cpu_moe_with_the_mlx_engine_is_a_usage_error(cli, tmp_path: Path) -> None:  # noqa: ANN001
    from localrun.cli import build_parser
    from localrun.cli.options import load_options_from_args

    folder = tmp_path / "mlx-model"  # an MLX folder by its config; refused before anything loads
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "quantization": {"bits": 4}}))
    res = cli("run", str(folder), PROMPT, "--cpu-moe", "1")
    assert res.returncode == 2 and "--cpu-moe works only with the llama.cpp engine" in res.stderr, res.stderr

    parser = build_parser()
    for command in (["run", "m"], ["batch", "m", "-i", "x.jsonl", "-o", "y.jsonl"], ["serve"], ["tui"]):
        args = parser.parse_args([*command, "--cpu-moe", "3"])
        assert load_options_from_args(args).cpu_moe == 3, command
    args = parser.parse_args(["tui", "--engine", "mlx", "--cpu-moe", "all"])
    with pytest.raises(UsageError, match="--cpu-moe works only with the llama.cpp engine"):
        load_options_from_args(args)
    # serve and the TUI pick the engine per model: the MLX engine itself refuses the option.
    from localrun.backends.mlx import MLXBackend
    from localrun.store import Store

    with pytest.raises(UsageError, match="--cpu-moe works only with the llama.cpp engine"):
        MLXBackend().load(Store().get(str(folder)), LoadOptions(cpu_moe=1))


def test_show_prints_experts_and_active_parameters(moe: MoeFile, cli) -> None:  # noqa: ANN001
    total = moe.parameters
    active = total - moe.expert_elements // 2  # 2 of 4 experts per token
    shown = cli("show", NAME)
    assert shown.returncode == 0, shown.stderr
    lines = {line[:16].strip(): line[16:] for line in shown.stdout.splitlines() if line and not line.startswith(" ")}
    assert lines["experts"] == "4 (2 active per token)"
    assert lines["parameters"] == f"{human_count(total)} ({total}), {human_count(active)} active ({active})"
    data = json.loads(cli("show", NAME, "--json").stdout)
    assert data["experts"] == {"count": 4, "used": 2, "shared": 0, "active_parameters": active,
                               "expert_bytes": moe.expert_elements * 4}
    assert data["parameters"] == total
    # A dense model has no experts row.
    api.add_model(need_asset("models", "stories260K.gguf"), name="stories:f32")
    assert "experts" not in cli("show", "stories:f32").stdout.split("metadata")[0]


# -- the fit estimate -----------------------------------------------------------------------------

GB = 1 << 30


def _machine(monkeypatch: pytest.MonkeyPatch, gpu: int | None, ram: int) -> None:
    import localrun.system

    monkeypatch.setattr(localrun.system, "gpus", lambda: [{"name": "Test GPU", "free_bytes": gpu}] if gpu else [])
    monkeypatch.setattr(localrun.system, "ram_bytes", lambda: (ram, ram))


def _big_moe() -> Experts:
    """A 48-layer, 128-expert model with 0.3 GiB of expert weights per layer (14.4 GiB)."""
    layer = 3 * GB // 10
    return Experts(count=128, used=8, shared=0, layers=48, active_parameters=3_000_000_000,
                   layer_bytes=dict.fromkeys(range(48), layer))


def test_fit_puts_the_expert_bytes_of_cpu_moe_layers_in_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    from localrun import fit

    _machine(monkeypatch, gpu=8 * GB, ram=64 * GB)
    shape = fit.Shape(layers=48, kv_heads=4, key_dim=128, value_dim=128, context_length=4096)
    experts = _big_moe()
    args = ("test/Big-MoE", ("big.gguf",), 16 * GB, shape, 1024, 30_000_000_000, 3_000_000_000, experts)
    whole = fit.estimate(*args)
    assert whole.verdict == "ram" and whole.host_bytes == 0 and whole.device_bytes == whole.total_bytes
    # 16 GiB of weights, 0.3 GiB of experts per layer: the GPU's 7.2 usable GiB need most layers' experts in RAM.
    n = whole.suggested_cpu_moe
    assert isinstance(n, int) and 0 < n < 48
    fits = fit.estimate(*args, cpu_moe=n)
    assert fits.verdict == "gpu" and "expert weights of" in fits.verdict_text
    assert fits.host_bytes == n * experts.layer_bytes[0] and fits.cpu_moe_layers == n
    assert fits.device_bytes == fits.total_bytes - fits.host_bytes <= 8 * GB * fit.GPU_USABLE
    short = fit.estimate(*args, cpu_moe=n - 1)
    assert short.verdict == "ram" and short.suggested_cpu_moe == n
    every = fit.estimate(*args, cpu_moe="all")
    assert every.host_bytes == experts.expert_bytes and every.cpu_moe_layers == 48
    assert every.suggested_cpu_moe is None
    d = fits.to_dict()
    assert (d["parameters"], d["active_parameters"], d["expert_count"], d["expert_used_count"]) == \
        (30_000_000_000, 3_000_000_000, 128, 8)
    assert d["host_bytes"] + d["device_bytes"] == d["total_bytes"]

    # Experts in RAM need the RAM too; without a GPU nothing is suggested.
    _machine(monkeypatch, gpu=8 * GB, ram=4 * GB)
    assert fit.estimate(*args, cpu_moe=n).verdict == "none"
    _machine(monkeypatch, gpu=None, ram=64 * GB)
    assert fit.estimate(*args).suggested_cpu_moe is None


def test_fit_counts_active_parameters_from_the_gguf_header(moe_file: MoeFile) -> None:
    from localrun import fit

    moe_gguf = moe_file.path
    meta = read_gguf(moe_gguf)
    total, active, experts = fit.parameters_from_gguf(meta)
    assert experts is not None and (experts.count, experts.used, experts.layers) == (4, 2, 2)
    assert total == moe_file.parameters and active == total - moe_file.expert_elements // 2
    assert experts.host_bytes(1) == experts.layer_bytes[0] == moe_file.expert_elements * 4 // 2
    # The store reads every part's header once; show and --cpu-moe read its details.
    assert model_experts(api.add_model(moe_gguf, name=NAME).details) == experts_of([meta]) == experts
    # Only the first part's header read (a split file): counts scale with the weights' bytes, and
    # a layer the header did not list counts as the mean of those it did.
    total2, active2, _ = fit.parameters_from_gguf(meta, 2 * meta.size)
    assert (total2, active2) == (2 * total, 2 * active)
    half = Experts(4, 2, 0, 4, 0, {0: 100, 1: 300}, complete=False)
    assert half.host_bytes(3) == 100 + 300 + 200 and half.host_bytes("all") == 800
    # A dense model has no experts.
    assert fit.parameters_from_gguf(read_gguf(need_asset("models", "stories260K.gguf")), 1)[1:] == (None, None)


def test_a_dense_layer_keeps_no_expert_bytes_in_ram() -> None:
    # DeepSeek and GLM begin with dense layers: every part read, a layer without expert tensors is 0 bytes.
    dense_first = Experts(64, 6, 1, 4, 0, {1: 100, 2: 100, 3: 100})
    assert dense_first.host_bytes(1) == 0 and dense_first.host_bytes(2) == 100
    assert dense_first.host_bytes("all") == dense_first.expert_bytes == 300
    # Only the first part's header read: a gap before its last layer is dense, layers after it unread.
    partial = Experts(64, 6, 1, 6, 0, {1: 100, 2: 300}, complete=False)
    assert partial.host_bytes(3) == 400 and partial.host_bytes("all") == 400 + 3 * 200
    assert Experts.from_dict(json.loads(json.dumps(partial.to_dict()))) == partial


@pytest.fixture
def moe_hub(moe_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A local Hub serving the MoE GGUF (HF_ENDPOINT points at it)."""
    import huggingface_hub.constants as constants

    from tests.hub.server import HubServer

    repo = "test/Tiny-MoE-GGUF"
    with HubServer() as server:
        server.add_repo(repo, {moe_gguf.name: moe_gguf}, tags=["gguf"])
        for key, value in server.env().items():
            if key != "HOME":
                monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield f"{repo}:{moe_gguf.name}"


def test_pull_check_shows_active_parameters_and_experts(moe_hub: str, moe_file: MoeFile, cli) -> None:  # noqa: ANN001
    res = cli("pull", "--check", moe_hub, "--json")
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    total = moe_file.parameters
    assert est["parameters"] == total and est["active_parameters"] == total - moe_file.expert_elements // 2
    assert (est["expert_count"], est["expert_used_count"]) == (4, 2)
    assert est["expert_bytes"] == moe_file.expert_elements * 4
    text = cli("pull", "--check", moe_hub).stdout
    assert f"{human_count(total)} ({human_count(est['active_parameters'])} active)" in text
    assert "4 (2 active per token)" in text


def test_pull_check_places_the_experts_of_cpu_moe_layers_in_ram(moe_hub: str, moe_file: MoeFile, cli) -> None:  # noqa: ANN001
    layer = moe_file.expert_elements * 4 // 2  # F32 bytes of one layer's experts
    for flag, layers, host in (("1", 1, layer), ("all", 2, 2 * layer)):
        res = cli("pull", "--check", moe_hub, "--cpu-moe", flag, "--json")
        assert res.returncode == 0, res.stderr
        est = json.loads(res.stdout)
        assert (est["cpu_moe_layers"], est["host_bytes"]) == (layers, host), flag
        assert est["device_bytes"] == est["total_bytes"] - host
    text = cli("pull", "--check", moe_hub, "--cpu-moe", "1").stdout
    assert "expert weights in RAM (--cpu-moe 1)" in text
    assert cli("pull", "--check", moe_hub, "--json").stdout.count('"host_bytes": 0') == 1
    bad = cli("pull", "--check", moe_hub, "--cpu-moe", "some")
    assert bad.returncode == 2 and "expected 'all' or a number" in bad.stderr
