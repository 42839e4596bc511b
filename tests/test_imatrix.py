"""Importance matrices on llama.cpp (localrun imatrix), checked against a numpy forward pass of the
same GGUF, and accepted by llama.cpp's quantizer (localrun quantize --imatrix)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from localrun.errors import EngineCrashedError, UsageError
from localrun.workbench.imatrix import compute_imatrix
from localrun.workbench.texts import default_calibration

from .conftest import run_cli
from .ggufs import without_byte_tokens

TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park "
    "with her red ball. One day, she saw a big dog under a tree. The dog was sad because it was "
    "lost. Lily said, \"Do not be sad, dog. I will help you find your home.\" They walked and "
    "walked until they found a small house with a blue door. A kind old man came out and smiled. "
    "\"Thank you for finding my dog!\" he said. Lily was happy. She went home and told her mom "
    "all about the dog. Her mom gave her a big hug and a warm cookie. The next day, Tom and his "
    "sister Sue went to the beach. They built a tall sand castle and looked for shells. A crab "
    "came out of the water and pinched Tom's toe. Tom cried, but Sue laughed and said the crab "
    "just wanted to play. Tom laughed too. They shared their apples and watched the sun go down. "
)
N_CTX = 64
LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    r = GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: np.array(t.data, dtype=np.float64) for t in r.tensors}


def _tokenize(model: Path, text: str) -> list[int]:
    """The token ids llama-imatrix evaluates: BOS added, no special-token parsing."""
    import llama_cpp as ll

    ll.llama_backend_init()
    params = ll.llama_model_default_params()
    params.vocab_only = True
    m = ll.llama_model_load_from_file(str(model).encode(), params)
    try:
        data = text.encode()
        buf = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(ll.llama_model_get_vocab(m), data, len(data), buf, len(buf), True, False)
        return list(buf[:n])
    finally:
        ll.llama_model_free(m)


# -- an independent reference: the Llama forward pass in numpy (float64) -------------------------

class _Reference:
    """Sums of squared inputs per weight matrix, from numpy's forward pass of a llama-arch GGUF."""

    def __init__(self, path: Path) -> None:
        fields, self.w = _read(path)
        self.n_layer = fields["llama.block_count"]
        self.n_head = fields["llama.attention.head_count"]
        self.n_kv = fields["llama.attention.head_count_kv"]
        self.eps = fields["llama.attention.layer_norm_rms_epsilon"]
        self.base = fields.get("llama.rope.freq_base", 10000.0)
        self.n_used = fields.get("llama.expert_used_count", 0)
        self.bos = fields["tokenizer.ggml.bos_token_id"]
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, np.ndarray] = {}

    def _add(self, name: str, x: np.ndarray, expert: int = 0, n_expert: int = 1) -> None:
        s = self.sums.setdefault(name, np.zeros((n_expert, x.shape[-1])))
        c = self.counts.setdefault(name, np.zeros(n_expert))
        s[expert] += (x * x).sum(axis=0)
        c[expert] += len(x)

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps) * w

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """llama.cpp's NORM rope (adjacent pairs), x: (tokens, heads, head_dim)."""
        t, _, d = x.shape
        theta = np.arange(t)[:, None] * self.base ** (-np.arange(0, d, 2) / d)[None, :]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out

    def chunk(self, ids: list[int]) -> None:
        w = self.w
        h = w["token_embd.weight"][[self.bos, *ids[1:]]]  # the chunk's first token becomes BOS
        t = len(ids)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            x = self._norm(h, w[p + "attn_norm.weight"])
            for m in ("attn_q", "attn_k", "attn_v"):
                self._add(p + m + ".weight", x)
            q = (x @ w[p + "attn_q.weight"].T).reshape(t, self.n_head, -1)
            k = (x @ w[p + "attn_k.weight"].T).reshape(t, self.n_kv, -1)
            v = (x @ w[p + "attn_v.weight"].T).reshape(t, self.n_kv, -1)
            q, k = self._rope(q), self._rope(k)
            k, v = _f16(k), _f16(v)  # llama.cpp's KV cache is F16 by default
            rep = self.n_head // self.n_kv
            k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
            scores += np.triu(np.full((t, t), -np.inf), 1)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            att = np.einsum("hqk,khd->qhd", scores / scores.sum(-1, keepdims=True), v).reshape(t, -1)
            self._add(p + "attn_output.weight", att)
            h = h + att @ w[p + "attn_output.weight"].T
            x = self._norm(h, w[p + "ffn_norm.weight"])
            h = h + (self._moe(p, x) if self.n_used else self._ffn(p, x))

    def _ffn(self, p: str, x: np.ndarray) -> np.ndarray:
        w = self.w
        self._add(p + "ffn_gate.weight", x)
        self._add(p + "ffn_up.weight", x)
        g, u = x @ w[p + "ffn_gate.weight"].T, x @ w[p + "ffn_up.weight"].T
        a = g / (1 + np.exp(-g)) * u
        self._add(p + "ffn_down.weight", a)
        return a @ w[p + "ffn_down.weight"].T

    def _moe(self, p: str, x: np.ndarray) -> np.ndarray:
        """Softmax routing, top n_used, weights renormalised (llama.cpp's Mixtral path)."""
        w = self.w
        self._add(p + "ffn_gate_inp.weight", x)
        logits = x @ w[p + "ffn_gate_inp.weight"].T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        n_expert = probs.shape[1]
        out = np.zeros_like(x)
        for row in range(len(x)):
            chosen = np.argsort(-probs[row])[: self.n_used]
            weights = probs[row, chosen] / probs[row, chosen].sum()
            xr = x[row : row + 1]
            for e, wt in zip(chosen, weights, strict=True):
                for m in ("ffn_gate_exps", "ffn_up_exps"):
                    self._add(p + m + ".weight", xr, e, n_expert)
                g = xr @ w[p + "ffn_gate_exps.weight"][e].T
                a = g / (1 + np.exp(-g)) * (xr @ w[p + "ffn_up_exps.weight"][e].T)
                self._add(p + "ffn_down_exps.weight", a, e, n_expert)
                out[row] += wt * (a @ w[p + "ffn_down_exps.weight"][e].T)[0]
        return out


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _reference(model: Path, text: str, n_ctx: int) -> _Reference:
    ref = _Reference(model)
    tokens = _tokenize(model, text)
    for i in range(len(tokens) // n_ctx):
        ref.chunk(tokens[i * n_ctx : (i + 1) * n_ctx])
    return ref


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel(), b.ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


# -- GGUF variants of the real model: a mixture of experts, a wide one --------------------------

def _variant(src: Path, dst: Path, keys: dict[str, Any], tensors: dict[str, np.ndarray]) -> Path:
    """src's metadata with `keys` replaced (or added, as uint32), and these F32 tensors."""
    r = GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in keys:
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, list(f.contents()), vt, sub_type=f.types[1])
        else:
            w.add_key_value(key, f.contents(), vt)
    for key, value in keys.items():
        w.add_uint32(key, value)
    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _moe_variant(src: Path, dst: Path, n_expert: int = 4, n_used: int = 2) -> Path:
    """Each FFN becomes n_expert perturbed copies of itself behind a random router."""
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {}
    for t in GGUFReader(src).tensors:
        a = np.array(t.data)
        _, blk, kind, _ = ([*t.name.split("."), "", "", ""])[:4]
        if kind in ("ffn_gate", "ffn_up", "ffn_down"):
            out[f"blk.{blk}.{kind}_exps.weight"] = np.stack(
                [a * (1 + 0.2 * rng.standard_normal(a.shape)) for _ in range(n_expert)])
            if kind == "ffn_gate":
                out[f"blk.{blk}.ffn_gate_inp.weight"] = rng.standard_normal((n_expert, a.shape[1]))
        else:
            out[t.name] = a
    return _variant(src, dst, {"llama.expert_count": n_expert, "llama.expert_used_count": n_used}, out)


def _wide_variant(src: Path, dst: Path, d: int = 256, ff: int = 512) -> Path:
    """Random weights with rows of 256, which i-quants need (stories260K's rows are 64)."""
    rng = np.random.default_rng(1)
    fields, w = _read(src)
    n_head, n_kv = fields["llama.attention.head_count"], fields["llama.attention.head_count_kv"]
    n_vocab = w["token_embd.weight"].shape[0]
    kv = d // n_head * n_kv
    shapes = {"attn_q": (d, d), "attn_k": (kv, d), "attn_v": (kv, d), "attn_output": (d, d),
              "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
    out = {"token_embd.weight": rng.standard_normal((n_vocab, d)), "output_norm.weight": np.ones(d),
           "output.weight": rng.standard_normal((n_vocab, d)) / np.sqrt(d)}
    for i in range(fields["llama.block_count"]):
        out[f"blk.{i}.attn_norm.weight"] = out[f"blk.{i}.ffn_norm.weight"] = np.ones(d)
        for m, shape in shapes.items():
            out[f"blk.{i}.{m}.weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
    keys = {"llama.embedding_length": d, "llama.feed_forward_length": ff,
            "llama.rope.dimension_count": d // n_head}
    return _variant(src, dst, keys, out)


# -- tests ----------------------------------------------------------------------------------------

def test_imatrix_matches_a_numpy_forward_pass(stories: Path, tmp_path: Path) -> None:
    out = tmp_path / "imatrix.gguf"
    events: list[Any] = []
    summary = compute_imatrix(stories, TEXT, out, n_ctx=N_CTX, progress=events.append)
    n_chunks = len(_tokenize(stories, TEXT)) // N_CTX
    assert n_chunks >= 3
    assert summary.chunks == n_chunks and summary.path == out and summary.tensors == 35
    assert [e.chunk for e in events][-1] == n_chunks and events[-1].chunks == n_chunks
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imatrix.gguf"]  # no temporary left

    fields, tensors = _read(out)
    assert fields["general.type"] == "imatrix"
    assert "general.architecture" not in fields  # as llama-imatrix writes it
    assert fields["imatrix.chunk_count"] == n_chunks
    assert fields["imatrix.chunk_size"] == N_CTX
    assert fields["imatrix.datasets"] == [summary.dataset]
    # one pair per weight matrix of every block (llama-imatrix skips token_embd and output)
    names = {f"blk.{i}.{m}.weight" for i in range(5) for m in LAYER_MATRICES}
    assert set(tensors) == {f"{n}.{s}" for n in names for s in ("in_sum2", "counts")}

    ref = _reference(stories, TEXT, N_CTX)
    assert set(ref.sums) == names
    for name in names:
        got = tensors[f"{name}.in_sum2"]
        assert tensors[f"{name}.counts"].tolist() == [n_chunks * N_CTX]
        assert got.shape == (ref.sums[name].shape[1],)  # 1-D for a dense weight, like ggml writes
        assert _cos(got, ref.sums[name]) > 0.99999, name
        np.testing.assert_allclose(got, ref.sums[name][0], rtol=3e-3, err_msg=name)


def test_mixture_of_experts_is_collected_per_expert(stories: Path, tmp_path: Path) -> None:
    moe = _moe_variant(stories, tmp_path / "moe.gguf")
    out = tmp_path / "moe-imatrix.gguf"
    compute_imatrix(moe, TEXT, out, n_ctx=N_CTX, isolated=False)
    _, tensors = _read(out)
    ref = _reference(moe, TEXT, N_CTX)
    n_tokens = len(_tokenize(moe, TEXT)) // N_CTX * N_CTX
    for i in range(5):
        for m in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            name = f"blk.{i}.{m}.weight"
            counts = tensors[f"{name}.counts"].reshape(-1)
            assert tensors[f"{name}.in_sum2"].shape == ref.sums[name].shape  # experts x columns
            assert counts.sum() == 2 * n_tokens  # every token reaches two experts
            # float32 and float64 routing may differ on a near tie: a token or two
            np.testing.assert_allclose(counts, ref.counts[name], atol=3, err_msg=name)
            assert _cos(tensors[f"{name}.in_sum2"], ref.sums[name]) > 0.999, name
        gate = f"blk.{i}.ffn_gate_inp.weight"  # the router is an ordinary matrix product
        assert _cos(tensors[f"{gate}.in_sum2"], ref.sums[gate]) > 0.99999


def test_quantize_takes_the_imatrix(stories: Path, tmp_path: Path) -> None:
    wide = _wide_variant(stories, tmp_path / "wide.gguf")
    imatrix = tmp_path / "wide-imatrix.gguf"
    compute_imatrix(wide, TEXT, imatrix, n_ctx=N_CTX)
    # iq2_xxs: refused without an importance matrix, made with one
    no = run_cli("quantize", str(wide), "iq2_xxs", "-o", str(tmp_path / "no.gguf"), "--no-register")
    assert no.returncode != 0 and "importance matrix" in no.stderr
    res = run_cli("quantize", str(wide), "iq2_xxs", "--imatrix", str(imatrix), "-o",
                  str(tmp_path / "iq2.gguf"), "--no-register")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(tmp_path / "iq2.gguf")
    types = {t.name: Q(t.tensor_type) for t in GGUFReader(tmp_path / "iq2.gguf").tensors}
    assert types["blk.0.ffn_up.weight"] == Q.IQ2_XXS
    # iq3_xxs: llama.cpp's own rule (tensor_requires_imatrix) refuses it without an importance
    # matrix (convert.outtypes.NEEDS_IMATRIX lets it through to llama.cpp); with one it is made
    import convert

    with pytest.raises(convert.ConvertError, match="iq3_xxs"):
        convert.quantize(wide, tmp_path / "iq3-no.gguf", "iq3_xxs")
    iq3 = convert.quantize(wide, tmp_path / "iq3.gguf", "iq3_xxs", imatrix=imatrix)
    assert Q.IQ3_XXS in {Q(t.tensor_type) for t in GGUFReader(iq3).tensors}


def test_cli_writes_the_file_and_prints_its_path(stories: Path, tmp_path: Path) -> None:
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT * 2)
    out = tmp_path / "out" / "stories.imatrix.gguf"
    out.parent.mkdir()
    res = run_cli("imatrix", str(stories), "--calibration", str(text), "-o", str(out), "--ctx", "64",
                  "--chunks", "2", "--threads", "1")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{out}\n"
    fields, _ = _read(out)
    assert fields["imatrix.datasets"] == [str(text)] and fields["imatrix.chunk_count"] == 2
    again = run_cli("imatrix", str(stories), "-f", str(text), "-o", str(out), "--ctx", "64")
    assert again.returncode == 2 and "already exists" in again.stderr and "--force" in again.stderr
    # the default calibration set when none is given
    res = run_cli("imatrix", str(stories), "-o", str(out), "--ctx", "64", "--chunks", "2", "--force")
    assert res.returncode == 0, res.stderr
    fields, _ = _read(out)
    assert fields["imatrix.datasets"][0].startswith("localrun-calibration-v1 (Python ")
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


def test_too_little_text_is_an_error_and_leaves_nothing(stories: Path, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="fewer than one chunk of 512"):
        compute_imatrix(stories, "Once upon a time.", tmp_path / "x.gguf")
    text = tmp_path / "short.txt"
    text.write_text("Once upon a time.")
    res = run_cli("imatrix", str(stories), "-f", str(text), "-o", str(tmp_path / "x.gguf"))
    assert res.returncode != 0 and "fewer than one chunk" in res.stderr and res.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_a_native_abort_is_an_error(stories: Path, tmp_path: Path) -> None:
    broken = without_byte_tokens(stories, tmp_path / "nobytes.gguf")  # llama.cpp aborts on CJK text
    with pytest.raises(EngineCrashedError, match=r"crashed while computing the importance matrix of nobytes.gguf "
                                                 r"\(signal SIGABRT"):
        compute_imatrix(broken, "Tokyo 東京 " * 100, tmp_path / "x.gguf", n_ctx=N_CTX)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nobytes.gguf"]


def test_default_calibration_is_deterministic_real_text() -> None:
    text, name = default_calibration()
    assert (text, name) == default_calibration()
    assert len(text) >= 100_000
    assert 'The "for" statement' in text or "statement" in text  # Python reference prose
    assert "\ndef " in text  # standard-library source
    assert "| U+" in text and "- U+" in text  # Unicode lists and tables
    assert name.startswith("localrun-calibration-v1") and "sha256" in name


def test_ggml_tensor_layout_matches_this_llama_cpp() -> None:
    from localrun.workbench import imatrix

    g = imatrix._ggml_lib()  # raises when the struct or the op numbers are off
    assert g.ggml_tensor_overhead() == ctypes.sizeof(imatrix._GgmlTensor) + 32
