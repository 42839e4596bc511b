"""Helpers of the converter tests: tiny random checkpoints, real tokenizers, llama.cpp probes."""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader

from tests.conftest import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT.parent / "shared" / "assets"
PROBE = Path(__file__).with_name("_llama_probe.py")

# Code, digits, non-Latin scripts, emoji, leading and repeated spaces.
MIXED_TEXT = (
    "  def add(a, b):\n    return a + b  # 12345 + 67.89\n"
    "Привет, мир!  你好，世界 こんにちは 🦙🚀 émigré   café\t\ttabs 1000000 x² <b>ok</b>"
)


# Longer text for the logit checks: 99% agreement needs a few hundred positions to mean anything.
LOGIT_TEXT = MIXED_TEXT + (
    "\nOnce upon a time, a little robot named Bolt lived in a quiet town. Every morning he counted "
    "the 42 birds on the roof, 7 cats in the yard and 3 dogs near the gate.\n"
    "for (int i = 0; i < n; ++i) { total += values[i] * 2; }\n"
    "Les élèves ont étudié l'histoire de l'Égypte ancienne pendant 3 semaines.\n"
    "データを読み込んで、結果を表示します。 数字: 3.14159, 2.71828; 😀😃😄 — the end."
)

# Top-1 agreement a file must reach on a model whose layers decide half the top-1s (make_layered):
# measured f16 1.00, q8_0 0.97-1.00, q4_k_m 0.92; with one layer broken, 0.44-0.76.
AGREEMENT = {"f16": 0.99, "q8_0": 0.95, "q4_k_m": 0.85}
LAYER_SHARE = 0.5  # the share of positions whose top-1 the layers decide
HUBS, HUB_SCALE = 64, 3.0  # frequent tokens and how much longer their embeddings are


def need_asset(*parts: str) -> Path:
    path = ASSETS.joinpath(*parts)
    if not path.exists():
        skip_or_fail(f"test asset {path} is missing (see ../shared/assets/README.md)")
    return path


def llama_probe(
    model: Path,
    *,
    tokenize: list[str] | None = None,
    logits: list[list[int]] | None = None,
    top1: list[list[int]] | None = None,
    generate: dict | None = None,
    n_ctx: int = 512,
    lora: list[tuple[Path, float]] | None = None,
    parse_special: bool = False,
) -> dict[str, np.ndarray]:
    """Run llama.cpp on a GGUF (with GGUF LoRA adapters and scales) in a child process.

    top1: ids whose logits' argmax per position is wanted (taken in the child, as "top1_0", ...).
    parse_special: tokenize special-token text as the special tokens (as a chat prompt is)."""
    req_path = model.with_suffix(".probe.json")
    out_path = model.with_suffix(".probe.npz")
    req = {
        "model": str(model),
        "tokenize": tokenize,
        "logits": logits,
        "top1": top1,
        "generate": generate,
        "n_ctx": n_ctx,
        "lora": [[str(path), float(scale)] for path, scale in lora or ()],
        "parse_special": parse_special,
    }
    req_path.write_text(json.dumps(req))
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(req_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise AssertionError(f"llama.cpp probe failed ({proc.returncode}): {proc.stderr[-2000:]}")
    with np.load(out_path) as data:
        return {k: data[k] for k in data.files}


# --- tiny checkpoints ---------------------------------------------------------------------------


@functools.cache
def _tokenizer(kind: str):  # noqa: ANN202
    """The asset's tokenizer, loaded once per session (nothing changes it; a Qwen3 one takes ~1 s)."""
    from transformers import AutoTokenizer

    # AutoTokenizer on tokenizer.model keeps SentencePiece's dummy prefix (transformers 5's
    # LlamaTokenizer class does not prepend it before a leading space, unlike sentencepiece).
    return AutoTokenizer.from_pretrained(str(need_asset("tokenizers", kind)))


def randomize(model, norm_center: float = 1.0, seed: int = 0, peaked: bool = False) -> None:  # noqa: ANN001
    """Random weights everywhere, norms and biases included, so that a dropped tensor shows.

    peaked: tied unit-scale embeddings dominate the residual stream, so that each position has a
    clear winner (as trained models do); random logits over 32k tokens are near-ties everywhere.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Gemma's post-norms scale each block's output: keep them below the embedding.
                center = -0.45 if peaked and norm_center == 0 and ".post_" in name else norm_center
                p.copy_(center + (torch.rand(p.shape, generator=g) - 0.5) * 0.6)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif peaked and "embed_tokens" in name:
                # Gemma multiplies the embeddings by sqrt(hidden): keep the residual at unit scale.
                std = 1.0 if norm_center else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5))


def _config(arch: str, vocab: int, bos: int | None, eos: int | None, peaked: bool = False):  # noqa: ANN202
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if arch == "llama":
        return tf.LlamaConfig(
            **common,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        )
    if arch == "mistral":
        return tf.MistralConfig(
            **{**common, "sliding_window": None}, head_dim=32, tie_word_embeddings=False
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if arch == "phi3":
        return tf.Phi3Config(
            **{**common, "num_key_value_heads": 4},
            tie_word_embeddings=False,
            original_max_position_embeddings=512,
            pad_token_id=0,
        )
    if arch == "gemma2":
        return tf.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            hidden_activation="gelu_pytorch_tanh",
        )
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        )
    if arch == "phi4":
        # Phi-4-mini's shape: grouped-query heads, partial rotary with LongRoPE factors, no sliding
        # window, tied embeddings (the short factors apply: the context stays within the original)
        rot = int(64 * 0.75) // 4 // 2
        return tf.Phi3Config(
            **common,
            tie_word_embeddings=True,
            sliding_window=None,
            original_max_position_embeddings=512,
            partial_rotary_factor=0.75,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 250000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 512,
                "short_factor": [1.0 + 0.4 * i for i in range(rot)],
                "long_factor": [2.0 + 0.5 * i for i in range(rot)],
            },
            pad_token_id=None,
        )
    if arch == "smollm3":
        # four layers: llama.cpp leaves rope out of every fourth one (the last here)
        return tf.SmolLM3Config(
            **{**common, "num_hidden_layers": 4},
            no_rope_layer_interval=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 2000000.0},
            pad_token_id=None,
        )
    if arch == "granite":
        # multipliers far from 1 (and the attention scale far from 1/sqrt(head_dim) = 0.25); in
        # the peaked model a x12 embedding against x0.22 blocks would leave the layers no say
        return tf.GraniteConfig(
            **common,
            tie_word_embeddings=False,
            embedding_multiplier=0.5 if peaked else 12.0,
            residual_multiplier=0.55 if peaked else 0.22,
            attention_multiplier=0.09,
            logits_scaling=4.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "olmo2":
        return tf.Olmo2Config(
            **common,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            pad_token_id=None,
        )
    if arch == "olmo3":
        # four layers, the default pattern: three sliding (a window shorter than the test text)
        # and a full one; yarn on the full layer only, as OLMo 3's published configs set it
        return tf.Olmo3Config(
            **{**common, "num_hidden_layers": 4},
            tie_word_embeddings=False,
            sliding_window=4,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                    "attention_factor": 0.1 * math.log(4.0) + 1,  # as published: YaRN's own
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            },
            pad_token_id=None,
        )
    raise ValueError(arch)


TOKENIZER_OF = {
    "llama": "llama2-spm",
    "mistral": "llama2-spm",
    "phi3": "llama2-spm",
    "gemma2": "llama2-spm",
    "gemma3": "llama2-spm",
    "qwen2": "qwen3",
    "qwen3": "qwen3",
    "phi4": "qwen3",  # Phi-4's vocabulary is byte-level BPE (GPT2Tokenizer)
    "smollm3": "llama2-spm",
    "granite": "llama2-spm",
    "olmo2": "qwen3",  # OLMo 2's vocabulary is byte-level BPE
    "olmo3": "qwen3",
}
ARCHS = list(TOKENIZER_OF)


# Parameters that make_checkpoint's gain= scales: attention output projections and the MoE
# experts' down projections (fused "experts.down_proj", Mixtral's w2, Granite's output_linear).
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj", "w2.weight", "output_linear")


def make_checkpoint(
    folder: Path,
    arch: str,
    *,
    dtype: str = "float32",
    safe: bool = True,
    shard_size: str | None = None,
    seed: int = 0,
    peaked: bool = False,
    config=None,  # noqa: ANN001
    tokenizer: str | None = None,
    gain: float = 1.0,
):  # noqa: ANN201
    """A random-weight checkpoint in Hugging Face layout with a real tokenizer; returns the model.

    config: keys that differ from the family's tiny config (another variant of the family), or a
    factory config(tok, peaked) giving the whole config (for families _config does not know).
    tokenizer: the tokenizer asset (default TOKENIZER_OF[arch]).
    gain: factor on the OUTPUT_PROJECTIONS after randomize(), so that in a peaked model the layers
    weigh more against the tied embeddings.
    """
    import torch
    import transformers as tf

    tok = _tokenizer(tokenizer or TOKENIZER_OF[arch])
    if callable(config):
        cfg = config(tok, peaked)
    else:
        cfg = _config(arch, len(tok), tok.bos_token_id, tok.eos_token_id, peaked)
        if config:
            cfg = type(cfg)(**{**cfg.to_dict(), **config})
    cfg._attn_implementation = "eager"
    if peaked:
        cfg.tie_word_embeddings = True
    cls = tf.Gemma3ForCausalLM if arch == "gemma3" else tf.AutoModelForCausalLM
    torch.manual_seed(seed)
    model = cls.from_config(cfg) if cls is tf.AutoModelForCausalLM else cls(cfg)
    if peaked:
        model.tie_weights()
    randomize(model, norm_center=0.0 if arch.startswith("gemma") else 1.0, seed=seed, peaked=peaked)
    if gain != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(OUTPUT_PROJECTIONS):
                    p.mul_(gain)
    model.eval()
    model = model.to(getattr(torch, dtype))
    kwargs = {}
    if shard_size:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(folder, **kwargs)
    if not safe:  # transformers 5 writes safetensors only: make the pickled layout by hand
        for f in list(folder.glob("model*.safetensors*")):
            f.unlink()
        torch.save(
            {k: v.contiguous() for k, v in model.state_dict().items()}, folder / "pytorch_model.bin"
        )
    tok.save_pretrained(folder)
    return model, tok


def reference_logits(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """transformers' logits in float32; a folder is loaded fresh (exact rope buffers for 16-bit saves)."""
    import torch

    if isinstance(model, (str, Path)):
        import transformers as tf

        model = tf.AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, attn_implementation="eager"
        )
        model.eval()
    with torch.no_grad():
        m = model.float()
        return m(torch.tensor([ids])).logits[0].float().numpy()


def logit_ids(tok) -> list[int]:  # noqa: ANN001
    """LOGIT_TEXT's token ids, after BOS where the tokenizer has one."""
    ids = tok.encode(LOGIT_TEXT, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


def assert_logits_close(got: np.ndarray, ref: np.ndarray) -> None:
    """llama.cpp's float32 logits are transformers': same top-1 everywhere, within 1e-3 of the span."""
    assert got.shape == ref.shape
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    span = float(ref.max() - ref.min())
    assert float(np.abs(got - ref).max()) < 1e-3 * span


def logits_and_routes(model, ids: list[int], n_used: int) -> tuple[np.ndarray, list[np.ndarray]]:  # noqa: ANN001
    """transformers' float32 logits and, per layer, the n_used experts each position routes to."""
    import torch

    with torch.no_grad():
        out = model.float()(torch.tensor([ids]), output_router_logits=True)
    routes = [
        r.float().topk(n_used, dim=-1).indices.sort(-1).values.numpy() for r in out.router_logits
    ]
    return out.logits[0].float().numpy(), routes


def greedy(model, ids: list[int], n: int) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation of ids, n tokens."""
    import torch

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids) :]


# --- top-1 agreement on a model whose layers matter ----------------------------------------------


def _layerless_top1(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    """Top-1 of the model with its decoder layers removed: what the embeddings alone predict."""
    import torch

    decoder = model.get_decoder()
    layers = decoder.layers
    decoder.layers = torch.nn.ModuleList()
    try:
        return reference_logits(model, ids).argmax(-1)
    finally:
        decoder.layers = layers


def layer_share(model, ids: list[int], layerless: np.ndarray | None = None) -> float:  # noqa: ANN001
    """Share of positions where the layers change the top-1 that the embeddings alone give."""
    if layerless is None:
        layerless = _layerless_top1(model, ids)
    return float((reference_logits(model, ids).argmax(-1) != layerless).mean())


def make_layered(model, ids: list[int], seed: int = 0) -> float:  # noqa: ANN001
    """Rescale a peaked model's tied embeddings so that the layers decide LAYER_SHARE of the top-1s.

    A few frequent tokens get longer embeddings (as in trained models), so that where the layers
    decide there is still a clear winner; the whole matrix is then scaled down until the layers
    outweigh the embedding at half the positions (the pre-norms keep their outputs as they were).
    Returns the share reached.
    """
    import torch

    emb = model.get_input_embeddings().weight
    rng = np.random.default_rng(seed)
    vocab = emb.shape[0]
    hubs = rng.choice(np.setdiff1d(np.arange(vocab), ids), HUBS, replace=False)
    with torch.no_grad():
        emb[torch.from_numpy(hubs)] *= HUB_SCALE
    base = emb.detach().clone()
    layerless = _layerless_top1(model, ids)  # the final norm makes it independent of the scale
    lo, hi = 0.1, 4.0
    for _ in range(7):  # bisection: the share falls as the embedding grows
        mid = (lo + hi) / 2
        with torch.no_grad():
            emb.copy_(base * mid)
        if layer_share(model, ids, layerless) >= LAYER_SHARE:
            lo = mid
        else:
            hi = mid
    with torch.no_grad():
        emb.copy_(base * lo)
    return layer_share(model, ids, layerless)


def save_layered(folder: Path, model, tok) -> tuple[list[int], np.ndarray, float]:  # noqa: ANN001
    """Calibrate a peaked model (make_layered), save it to folder, and return the ids, transformers'
    top-1s on them and the share of those the layers decide."""
    ids = logit_ids(tok)
    share = make_layered(model, ids)
    model.save_pretrained(folder)
    return ids, reference_logits(model, ids).argmax(-1), share


def top1_agreement(path: Path, ids: list[int], top1: np.ndarray) -> float:
    """Share of positions where llama.cpp on the GGUF picks the reference's top-1."""
    got = llama_probe(path, top1=[ids])["top1_0"]
    return float((got == top1).mean())


def break_last_layer(src: Path, dst: Path) -> str:
    """Copy src to dst with the last block's FFN output rows reversed (a wrong layout); returns it.

    Of that block's FFN down tensors (a MoE block's ffn_down_exps, over all its experts, and a
    shared expert's ffn_down_shexp) the largest is broken."""
    shutil.copyfile(src, dst)
    reader = gguf_reader(dst, "r+")
    downs = [t for t in reader.tensors if ".ffn_down" in t.name]
    last = max(int(t.name.split(".")[1]) for t in downs)
    tensor = max(
        (t for t in downs if int(t.name.split(".")[1]) == last), key=lambda t: int(t.n_elements)
    )
    rows = tensor.data.reshape(-1, tensor.data.shape[-1])
    rows[...] = rows[::-1].copy()
    reader.data.flush()
    del reader
    return tensor.name


# --- llama.cpp's own converter, from the llama-cpp-python sdist on PyPI --------------------------

LLAMA_CPP_PYTHON = "0.3.36"


def llama_cpp_converter_dir(cache: Path) -> Path:
    """vendor/llama.cpp of the sdist (convert_hf_to_gguf.py, conversion/, gguf-py/), downloaded once."""
    root = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(cache),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0 or not sdist.is_file():
            skip_or_fail(f"cannot download the llama-cpp-python sdist: {proc.stderr[-300:]}")
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and ("/models/" not in m.name or m.name.endswith(".py"))
        ]
        tar.extractall(cache, members=members, filter="data")
    return root


def converter_cache() -> Path:
    base = os.environ.get("LOCALRUN_TEST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "localrun-tests"
    )
    return Path(base)


class _PlainViewReader(GGUFReader):
    """gguf-py's GGUFReader, slicing a plain ndarray view of its memory map instead of the map.

    The same parser, fields and tensor bytes (a write in "r+" mode still reaches the file through
    `data.flush()`); each slice of an np.memmap goes through the subclass's hooks, which on a
    151k-token vocabulary is most of the reading time (about 7 s a file, under 2 s this way)."""

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: str | None = None
    ) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def gguf_reader(path: Path | str, mode: str = "r") -> GGUFReader:
    """A GGUFReader of the file, read faster (see _PlainViewReader)."""
    return _PlainViewReader(path, mode)  # type: ignore[arg-type]


def model_keys(r: GGUFReader) -> dict[str, object]:
    """A file's model metadata (the vocabulary's is the tokenizer tests' business)."""
    skip = ("GGUF.", "tokenizer.", "general.name")
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith(skip)}


def gguf_tensors(r: GGUFReader | Path) -> dict[str, tuple]:
    """Each tensor of a GGUF file (a reader or a path): (type, shape, bytes), by name."""
    if not isinstance(r, GGUFReader):
        r = gguf_reader(r)
    return {
        t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape), bytes(t.data))
        for t in r.tensors
    }


def convert_reference(converter_dir: Path, folder: Path, out: Path, outtype: str) -> Path:
    """Convert a checkpoint folder with llama.cpp's own convert_hf_to_gguf.py; returns out."""
    proc = subprocess.run(
        [sys.executable, str(converter_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
         "--outfile", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def reference_gguf(converter_dir: Path, folder: Path, out: Path, outtype: str) -> GGUFReader:
    """The file llama.cpp's own convert_hf_to_gguf.py makes of a checkpoint folder, read."""
    return gguf_reader(convert_reference(converter_dir, folder, out, outtype))
