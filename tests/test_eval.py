"""`localrun eval`: perplexity and KL divergence on real models, checked against numpy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from localrun.errors import BadModelFileError, EngineCrashedError, UsageError
from localrun.workbench.perplexity import EvalResult, evaluate, evaluate_in_worker

from .ggufs import without_byte_tokens

CTX = 128
CHUNKS = 4


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real English prose: the start of the Python language reference that ships with CPython."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[k] for k in sorted(topics))[:6000]
    path = tmp_path_factory.mktemp("eval") / "reference.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stories_quants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """stories260K (F32) quantized by llama.cpp to q8_0 and q4_0: a cheap ladder with a real vocabulary."""
    from convert.quantize import quantize_file

    from .conftest import STORIES, assets_or_skip

    src = assets_or_skip(STORIES)
    folder = tmp_path_factory.mktemp("quants")
    out = {}
    for q in ("q8_0", "q4_0"):
        out[q] = folder / f"stories260K-{q.upper()}.gguf"
        quantize_file(src, out[q], q, threads=2)
    return out


def _eval(model: Path, text: Path, reference: Path | None = None, **kw: object) -> EvalResult:
    return evaluate(model, text, reference, n_ctx=CTX, chunks=CHUNKS, threads=2, **kw)  # type: ignore[arg-type]


def test_model_against_itself_has_no_divergence(starter: Path, text_file: Path) -> None:
    r = evaluate(starter, text_file, starter, n_ctx=CTX, chunks=2, threads=2)
    d = r.divergence
    assert d is not None
    assert r.chunks == 2 and r.tokens == 2 * (CTX - 1 - CTX // 2) and r.n_vocab == 49152
    assert 1 < r.ppl < 1000
    assert d.kld_mean < 1e-6 and d.kld_max < 1e-5 and d.kld_min >= 0
    assert d.same_top == 1.0
    assert d.ppl_reference == pytest.approx(r.ppl, rel=1e-9)
    assert d.dp_rms < 1e-6 and d.ln_ppl_ratio == pytest.approx(0, abs=1e-9)


def test_quantized_models_diverge_more_the_fewer_bits(stories: Path, stories_quants: dict[str, Path],
                                                      text_file: Path) -> None:
    q8 = _eval(stories_quants["q8_0"], text_file, stories)
    q4 = _eval(stories_quants["q4_0"], text_file, stories)
    base = _eval(stories, text_file)
    assert q8.divergence is not None and q4.divergence is not None
    assert 1e-5 < q8.divergence.kld_mean < q4.divergence.kld_mean < 5
    assert q4.divergence.same_top < q8.divergence.same_top <= 1
    assert q4.divergence.kld_median <= q4.divergence.kld_p90 <= q4.divergence.kld_p99 <= q4.divergence.kld_max
    for r in (q8, q4, base):
        assert r.tokens == CHUNKS * (CTX - 1 - CTX // 2)
        assert 1 < r.ppl < r.n_vocab  # better than guessing among 512 tokens, worse than certain
    # The reference's perplexity in the KL statistics is its own perplexity on the same chunks.
    assert q4.divergence.ppl_reference == pytest.approx(base.ppl, rel=1e-6)
    assert q4.ppl > base.ppl


def _numpy_logits(path: Path, text: Path, n_ctx: int, chunks: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each chunk's scored logits and targets, via llama-cpp-python's high-level Llama (one
    sequence at a time, not our batched decode) and llama-perplexity's rules, re-done here."""
    import llama_cpp

    # Flash attention as llama-perplexity's "auto" picks it on CPU: off moves these logits by up to 0.3.
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, n_threads=2,
                          flash_attn=True)
    try:
        tokens = llm.tokenize(text.read_bytes(), add_bos=True, special=False)
        first = n_ctx // 2
        out = []
        for c in range(chunks):
            chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
            chunk[0] = llm.token_bos()
            llm.reset()
            llm.eval(chunk)
            logits = np.array(llm.scores[first:n_ctx - 1], dtype=np.float64)
            out.append((logits, np.array(tokens[c * n_ctx + first + 1:(c + 1) * n_ctx])))
        return out
    finally:
        llm.close()


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def test_perplexity_and_kld_agree_with_numpy(stories: Path, stories_quants: dict[str, Path], text_file: Path) -> None:
    ref = _numpy_logits(stories, text_file, CTX, CHUNKS)
    mod = _numpy_logits(stories_quants["q4_0"], text_file, CTX, CHUNKS)
    nll, kld, same = [], [], []
    for (xr, targets), (xm, _) in zip(ref, mod, strict=True):
        lp, lq = _log_softmax(xr), _log_softmax(xm)
        nll.append(-lq[np.arange(len(targets)), targets])
        kld.append((np.exp(lp) * (lp - lq)).sum(axis=1))
        same.append(xr.argmax(axis=1) == xm.argmax(axis=1))
    nll_all = np.concatenate(nll)
    ppl = float(np.exp(nll_all.mean()))
    ppl_err = ppl * float(np.sqrt(((nll_all ** 2).mean() - nll_all.mean() ** 2) / (len(nll_all) - 1)))

    r = _eval(stories_quants["q4_0"], text_file, stories)
    assert r.divergence is not None
    assert r.tokens == len(nll_all)
    assert r.ppl == pytest.approx(ppl, rel=1e-4)
    assert r.ppl_error == pytest.approx(ppl_err, rel=1e-3)
    exact = float(np.concatenate(kld).mean())
    assert r.divergence.kld_mean == pytest.approx(exact, rel=5e-3)  # the cache keeps 99.9% of the mass
    assert r.divergence.kld_median == pytest.approx(float(np.median(np.concatenate(kld))), rel=1e-2)
    assert r.divergence.same_top == pytest.approx(float(np.concatenate(same).mean()), abs=2 / len(nll_all))

    # A batch smaller than a chunk: several llama_decode calls a chunk, one sequence at a time. The
    # smaller ubatch moves this tiny model's float reductions (llama-perplexity -b 32 reads the same).
    small = evaluate(stories_quants["q4_0"], text_file, stories, n_ctx=CTX, chunks=CHUNKS, n_batch=CTX // 4, threads=2)
    assert small.n_batch == CTX // 4 and small.divergence is not None and small.divergence.cache_hit
    assert small.ppl == pytest.approx(ppl, rel=1e-2) and small.ppl != ppl
    assert small.divergence.kld_mean == pytest.approx(r.divergence.kld_mean, rel=5e-2)


def test_reference_logits_are_cached(stories: Path, stories_quants: dict[str, Path], text_file: Path,
                                     isolated_home: Path) -> None:
    first = _eval(stories_quants["q4_0"], text_file, stories)
    assert first.divergence is not None and not first.divergence.cache_hit
    cache = Path(first.divergence.cache_path)
    assert cache.parent.parent.parent == isolated_home and (cache / "meta.json").is_file()
    assert json.loads((cache / "meta.json").read_text())["n_chunk"] == CHUNKS

    again = _eval(stories_quants["q8_0"], text_file, stories)
    assert again.divergence is not None and again.divergence.cache_hit
    assert again.divergence.cache_path == str(cache) and again.divergence.reference_seconds == 0
    repeat = _eval(stories_quants["q4_0"], text_file, stories)
    assert repeat.divergence is not None and repeat.divergence.cache_hit
    assert repeat.divergence.kld_mean == first.divergence.kld_mean
    assert repeat.divergence.ppl_reference == first.divergence.ppl_reference

    # Another chunk count, another context, or a reference file that changed: computed afresh.
    for n_ctx, chunks in ((CTX, 2), (CTX // 2, CHUNKS)):
        other = evaluate(stories_quants["q4_0"], text_file, stories, n_ctx=n_ctx, chunks=chunks, threads=2)
        assert other.divergence is not None and not other.divergence.cache_hit
    copy = isolated_home.parent / "stories-copy.gguf"
    copy.write_bytes(stories.read_bytes())
    assert not _eval(stories_quants["q4_0"], text_file, copy).divergence.cache_hit  # type: ignore[union-attr]
    os.utime(copy, ns=(1, 1))
    assert not _eval(stories_quants["q4_0"], text_file, copy).divergence.cache_hit  # type: ignore[union-attr]


def test_different_vocabularies_are_refused(starter: Path, stories: Path, text_file: Path, isolated_home: Path) -> None:
    with pytest.raises(BadModelFileError, match=r"different vocabularies \(512 vs 49152 tokens\)") as e:
        _eval(stories, text_file, starter)
    assert "same tokenizer" in str(e.value)
    assert not (isolated_home / "cache").exists()  # refused before the reference was run


def test_bad_settings_and_short_text(stories: Path, tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("Once upon a time there was a tiny model.")
    with pytest.raises(UsageError, match=r"only \d+ tokens; --ctx 128 needs at least 256"):
        _eval(stories, short)
    with pytest.raises(UsageError, match="--batch-size 200 must be below --ctx 128 or a multiple"):
        evaluate(stories, short, n_ctx=128, n_batch=200)
    with pytest.raises(UsageError, match="cannot read the text file"):
        _eval(stories, tmp_path / "missing.txt")


def test_native_crash_in_the_worker_is_an_error(stories: Path, tmp_path: Path) -> None:
    broken = without_byte_tokens(stories, tmp_path / "nobytes.gguf")
    text = tmp_path / "chinese.txt"
    text.write_text("你好，世界。" * 200)
    with pytest.raises(EngineCrashedError, match="crashed while evaluating nobytes.gguf .signal SIGABRT"):
        evaluate_in_worker(broken, text, n_ctx=CTX, threads=2)
    assert evaluate_in_worker(stories, text, n_ctx=CTX, chunks=1, threads=2).chunks == 1  # and this process goes on


def test_cli_eval(cli: object, stories: Path, stories_quants: dict[str, Path], text_file: Path) -> None:
    args = [str(stories_quants["q4_0"]), "--reference", str(stories), "--text", str(text_file),
            "--ctx", str(CTX), "--chunks", "2", "--threads", "2"]
    r = cli("eval", *args, "--json")  # type: ignore[operator]
    assert r.returncode == 0, r.stderr
    record = json.loads(r.stdout)
    assert record["chunks"] == 2 and record["divergence"]["kld_mean"] > 0
    assert record["divergence"]["cache_hit"] is False
    assert "reference 2/2 chunks" in r.stderr and "model 2/2 chunks" in r.stderr  # progress on stderr only

    table = cli("eval", *args)  # type: ignore[operator]
    assert table.returncode == 0, table.stderr
    assert "mean KLD" in table.stdout and "(cached)" in table.stdout
    assert "reference" not in table.stderr  # the cached reference is not run again

    plain = cli("eval", str(stories), "--text", str(text_file), "--ctx", str(CTX), "--chunks", "2", "--json")  # type: ignore[operator]
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["divergence"] is None

    bad = cli("eval", str(stories), "--text", str(text_file), "--ctx", "4")  # type: ignore[operator]
    assert bad.returncode == 2 and "expected a number >= 8" in bad.stderr and not bad.stdout
    mismatch = cli("eval", str(stories), "--reference", "smollm2:135m", "--text", str(text_file),  # type: ignore[operator]
                   "--ctx", str(CTX))
    assert mismatch.returncode == 1 and "different vocabularies" in mismatch.stderr and not mismatch.stdout
