"""The numbers of a perplexity run, on logits already in hand (numpy only, no engine).

A chunk's rows are scored a block at a time: each row's softmax pieces give the target's negative
log-likelihood and the top token. A reference model's row is kept compressed: its likeliest
tokens until at most TAIL_MASS of probability is left, their log-probabilities as uint16 on a
per-row scale, the leftover mass, the target token's log-probability and the top token. The KL
divergence of a model's row from it is the sum of p log(p/q) - p + q over the kept tokens plus the
same for the leftover taken as one token. Scores gathers a pass's values into llama-perplexity's
statistics.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

TAIL_MASS = 1e-3  # a reference row keeps its likeliest tokens until less than this is left
_BLOCK = 1 << 20  # logits handled at once (rows x vocabulary)


@dataclass(frozen=True)
class Divergence:
    """How far the model's next-token distributions are from the reference's (llama-perplexity's
    --kl-divergence statistics; errors are one standard deviation of the mean)."""

    reference: str
    ppl_reference: float
    ppl_reference_error: float
    ln_ppl_ratio: float  # mean ln(PPL(model)/PPL(reference))
    ln_ppl_ratio_error: float
    ppl_ratio: float
    ppl_ratio_error: float
    ppl_diff: float
    ppl_diff_error: float
    ppl_correlation: float  # Cor(ln PPL(model), ln PPL(reference)) over tokens
    kld_mean: float
    kld_error: float
    kld_median: float
    kld_p90: float
    kld_p95: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    kld_min: float
    same_top: float  # share of positions where both models' most likely token is the same
    same_top_error: float
    dp_rms: float  # RMS of p_model(target) - p_reference(target)
    dp_rms_error: float
    dp_mean: float
    dp_mean_error: float
    dp_max: float  # largest delta p (most gained by the model)
    dp_min: float  # smallest (most lost)
    cache_hit: bool  # the reference's logits came from the cache
    cache_path: str
    reference_seconds: float  # 0 on a cache hit
    reference_path: str = ""  # the reference's file, when `reference` is its store name


@dataclass
class Parts:
    """Per-row softmax pieces of a chunk's logits x: e = exp(x - max) and its sum."""

    top: np.ndarray  # argmax (the first one, as llama-perplexity's loop finds it)
    lse: np.ndarray  # log-sum-exp (float64)
    nll: np.ndarray  # -log p(target)
    e: np.ndarray  # float32, (rows, n_vocab)
    total: np.ndarray  # float64 sum of e


def blocks(rows: np.ndarray, targets: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """A chunk's rows a few at a time: scratch arrays of a few MB stay in cache and in malloc's
    heap, where the whole chunk's (hundreds of MB) would be fresh pages every time."""
    step = max(1, _BLOCK // rows.shape[1])
    for r0 in range(0, len(rows), step):
        yield r0, rows[r0:r0 + step], targets[r0:r0 + step]


class Work:
    """Scratch arrays reused from block to block."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, int], dtype: type) -> np.ndarray:
        """The scratch array `name` in this shape, grown only when it is too small."""
        a = self.arrays.get(name)
        if a is None or a.size < shape[0] * shape[1] or a.dtype != dtype:
            a = self.arrays[name] = np.empty(shape[0] * shape[1], dtype=dtype)
        return a[: shape[0] * shape[1]].reshape(shape)


def softmax_parts(x: np.ndarray, targets: np.ndarray, work: Work) -> Parts:
    """The softmax pieces of rows x and the negative log-likelihood of their targets."""
    r = np.arange(len(x))
    top = x.argmax(axis=1)
    mx = x[r, top]
    e = np.subtract(x, mx[:, None], out=work.get("e", x.shape, np.float32))
    np.exp(e, out=e)
    total = e.sum(axis=1, dtype=np.float64)
    lse = mx.astype(np.float64) + np.log(total)
    return Parts(top, lse, lse - x[r, targets], e, total)


# Bins of e = exp(x - max) in (0, 1] by their float32 bits: exponent and 2 mantissa bits, so
# 4 bins an octave (0.17 nats), bin 508 holding e = 1.
_SHIFT = 21
_N_BINS = 512
_BIN_TOP = ((np.arange(_N_BINS, dtype=np.int64) + 1) << _SHIFT).astype(np.int32).view(np.float32).astype(np.float64)


def compress(x: np.ndarray, p: Parts, work: Work) -> dict[str, np.ndarray]:
    """A chunk's reference rows in the cache's form (see the module docstring).

    A row keeps its bins of e from the top down until the bins below, counted at their upper
    edges (so never under), hold at most TAIL_MASS: a histogram pass instead of a sort.
    """
    n, n_vocab = x.shape
    bins = work.get("bins", x.shape, np.intp)
    np.right_shift(p.e.view(np.int32), _SHIFT, out=bins)
    bins += (np.arange(n, dtype=np.intp) * _N_BINS)[:, None]
    counts_per_bin = np.bincount(bins.ravel(), minlength=n * _N_BINS).reshape(n, _N_BINS)
    bins -= (np.arange(n, dtype=np.intp) * _N_BINS)[:, None]
    below = np.cumsum(counts_per_bin * _BIN_TOP, axis=1) / p.total[:, None]  # bound on the mass of bins <= k
    cut = (below <= TAIL_MASS).sum(axis=1)  # keep bins >= cut
    flat = np.flatnonzero(bins >= cut[:, None])
    rows = flat // n_vocab
    idx = flat - rows * n_vocab
    counts = np.bincount(rows, minlength=n)
    lp = np.take(x.ravel(), flat) - p.lse[rows]
    hi = np.take(x.ravel(), np.arange(n) * n_vocab + p.top) - p.lse
    lo = np.minimum.reduceat(lp, np.concatenate(([0], np.cumsum(counts)[:-1])))  # every row keeps its top
    scale = (hi - lo) / 65535.0
    safe = np.where(scale > 0, scale, 1.0)
    q = np.rint((lp - lo[rows]) / safe[rows]).clip(0, 65535).astype(np.uint16)
    kept = np.bincount(rows, weights=np.take(p.e.ravel(), flat), minlength=n)
    return {
        "counts": counts,
        "index": idx.astype(np.uint16 if n_vocab <= 1 << 16 else np.uint32),
        "value": q,
        "scale": scale,
        "low": lo,
        "tail": np.maximum(p.total - kept, 0.0) / p.total,
        "top": p.top.astype(np.int32),
        "nll": p.nll,
    }


def kld_rows(x: np.ndarray, p: Parts, ref: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """KL(reference || model) per row, and whether the two top tokens agree."""
    n, n_vocab = x.shape
    rows = np.repeat(np.arange(n), ref["counts"])
    flat = rows * n_vocab + ref["index"]
    lp = ref["low"][rows] + ref["scale"][rows] * ref["value"]
    d = lp - (np.take(x.ravel(), flat) - p.lse[rows])
    kld = np.bincount(rows, weights=np.exp(lp) * (d + np.expm1(-d)), minlength=n)
    kept = np.bincount(rows, weights=np.take(p.e.ravel(), flat), minlength=n)
    q_tail = np.maximum(p.total - kept, 0.0) / p.total
    p_tail = ref["tail"]
    with np.errstate(divide="ignore", invalid="ignore"):
        dt = np.log(p_tail / np.maximum(q_tail, 1e-300))
        kld += np.where(p_tail > 0, p_tail * (dt + np.expm1(-dt)), q_tail)
    return kld, p.top == ref["top"]


def mean_err(v: np.ndarray) -> tuple[float, float]:
    """llama-perplexity's mean_and_uncertainty."""
    n = len(v)
    if n < 1:
        return 0.0, 0.0
    f = float(v.sum()) / n
    df = float((v * v).sum()) / n - f * f
    return f, (float(np.sqrt(df / (n - 1))) if df > 0 and n > 10 else 0.0)


class Scores:
    """Per-token values of one model pass, and the statistics llama-perplexity prints."""

    def __init__(self) -> None:
        self.nll: list[np.ndarray] = []
        self.kl: list[tuple[np.ndarray, np.ndarray]] = []
        self.count = 0

    def add(self, p: Parts, kl: tuple[np.ndarray, np.ndarray] | None) -> None:
        """A block's values (and its KL divergence and top agreement, against a reference)."""
        self.nll.append(p.nll)
        self.count += len(p.nll)
        if kl is not None:
            self.kl.append(kl)

    def ppl_so_far(self) -> float:
        """The perplexity of the positions added so far."""
        return float(np.exp(sum(float(v.sum()) for v in self.nll) / max(1, self.count)))

    def perplexity(self) -> tuple[float, float]:
        """The perplexity and its error, as llama-perplexity prints them."""
        nll = np.concatenate(self.nll)
        mean = float(nll.mean())
        var = float((nll * nll).mean()) - mean * mean
        ppl = float(np.exp(mean))
        return ppl, (float(np.sqrt(var / (len(nll) - 1))) * ppl if var > 0 and len(nll) > 1 else 0.0)

    def divergence(self, nll_base: np.ndarray, reference: str, hit: bool, cache: str, seconds: float) -> Divergence:
        """llama-perplexity's --kl-divergence statistics against the reference's nll_base."""
        nll = np.concatenate(self.nll)
        nll_base = np.asarray(nll_base, dtype=np.float64)
        kld = np.concatenate([k[0] for k in self.kl])
        same = np.concatenate([k[1] for k in self.kl])
        n = len(nll)
        lq, lq_err = mean_err(nll)
        lb, lb_err = mean_err(nll_base)
        cov = (float((nll * nll_base).sum()) / n - lq * lb) / (n - 1) if n >= 10 else 0.0
        ratio_err = float(np.sqrt(max(0.0, lq_err ** 2 + lb_err ** 2 - 2 * cov)))
        ppl, ppl_base = float(np.exp(lq)), float(np.exp(lb))
        ppl_err, base_err = ppl * lq_err, ppl_base * lb_err
        diff_err = float(np.sqrt(max(0.0, ppl_err ** 2 + base_err ** 2 - 2 * ppl * ppl_base * cov)))
        k_mean, k_err = mean_err(kld)
        dp = np.exp(-nll) - np.exp(-nll_base)
        dp_mean, dp_mean_err = mean_err(dp)
        mse, mse_err = mean_err(dp * dp)
        rms = float(np.sqrt(mse))
        top = float(same.mean())
        pct = np.percentile(kld, [90, 95, 99, 99.9])
        return Divergence(
            reference=reference,
            ppl_reference=ppl_base, ppl_reference_error=base_err,
            ln_ppl_ratio=lq - lb, ln_ppl_ratio_error=ratio_err,
            ppl_ratio=float(np.exp(lq - lb)), ppl_ratio_error=float(np.exp(lq - lb)) * ratio_err,
            ppl_diff=ppl - ppl_base, ppl_diff_error=diff_err,
            ppl_correlation=cov / (lq_err * lb_err) if lq_err > 0 and lb_err > 0 else 0.0,
            kld_mean=k_mean, kld_error=k_err, kld_median=float(np.median(kld)),
            kld_p90=float(pct[0]), kld_p95=float(pct[1]), kld_p99=float(pct[2]), kld_p999=float(pct[3]),
            kld_max=float(kld.max()), kld_min=float(kld.min()),
            same_top=top, same_top_error=float(np.sqrt(top * (1 - top) / (n - 1))) if n > 1 else 0.0,
            dp_rms=rms, dp_rms_error=0.5 / rms * mse_err if rms > 0 else 0.0,
            dp_mean=dp_mean, dp_mean_error=dp_mean_err, dp_max=float(dp.max()), dp_min=float(dp.min()),
            cache_hit=hit, cache_path=cache, reference_seconds=seconds,
        )
