"""The quantization ladder: one 16-bit reference, many quantized rungs, each measured.

`localrun quantize SOURCE --ladder q8_0,q6_k,q4_k_m,...` converts the source once (a Hugging
Face checkpoint to F16 GGUF; a 16/32-bit GGUF is used as it is), computes an importance matrix
once when a rung can use one, then for every rung: quantizes, evaluates against the reference
(perplexity, KL divergence, top-token agreement), benchmarks (prompt and generation tokens/s),
records provenance in the file and registers it in the store. The state is saved after every
rung, so an interrupted ladder resumes where it stopped and never redoes a finished rung.
The report (table, Markdown, JSON) recommends the smallest rung within a KLD budget.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import UsageError

# Types an importance matrix improves (k-quants and i-quants); IQ types below 4 bits need one.
IMATRIX_HELPS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "iq1_s", "iq1_m",
                 "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m", "iq4_xs", "iq4_nl")
DEFAULT_BUDGET = 0.05  # mean KLD a rung may lose against the reference and still be recommended
STATE = "ladder.json"


@dataclass
class Rung:
    """One quantized file and what was measured of it."""

    type: str
    path: str
    size: int
    bits_per_weight: float
    imatrix: bool
    ppl: float
    kld_mean: float
    kld_median: float
    kld_p99: float
    kld_max: float
    top_agreement: float
    rms_dp: float
    pp_tps: float
    tg_tps: float
    name: str = ""
    seconds: float = 0.0


@dataclass
class Ladder:
    """The whole ladder: the reference, the rungs measured so far, and the recommendation."""

    source: str
    reference: str
    reference_ppl: float
    text: str
    imatrix: str | None
    imatrix_dataset: str | None
    budget: float
    rungs: list[Rung] = field(default_factory=list)

    def recommended(self) -> Rung | None:
        """The smallest rung whose mean KLD is within the budget."""
        fits = [r for r in self.rungs if r.kld_mean <= self.budget]
        return min(fits, key=lambda r: r.size) if fits else None

    def to_dict(self) -> dict[str, Any]:
        rec = self.recommended()
        return {**asdict(self), "recommended": rec.type if rec else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Ladder:
        rungs = [Rung(**r) for r in data.get("rungs", [])]
        fields_ = {k: v for k, v in data.items() if k not in ("rungs", "recommended")}
        return cls(**fields_, rungs=rungs)


@dataclass(frozen=True)
class Step:
    """A ladder's progress: what it does now, for which rung (None: a step all rungs share), and
    how many rungs are built and measured (kept ones included)."""

    text: str
    rung: str | None = None
    done: int = 0

    def __str__(self) -> str:
        return f"{self.rung}: {self.text}" if self.rung else self.text


@dataclass
class Steps:
    """What the ladder calls for each step (the real ones in api.quantize_ladder; tests may wrap them)."""

    convert: Callable[[Path, Path], Path]  # source checkpoint -> F16 GGUF
    imatrix: Callable[[Path, Path, Path | None], str]  # reference, out, calibration -> dataset description
    quantize: Callable[[Path, Path, str, Path | None], None]  # reference, out, type, imatrix
    evaluate: Callable[[Path, Path, Path], dict[str, float]]  # rung, reference, text -> statistics (+ ppl_reference)
    bench: Callable[[Path], tuple[float, float]]  # rung -> (pp tokens/s, tg tokens/s)
    register: Callable[[Path, str], str]  # rung file, type -> store name
    provenance: Callable[[Path, dict[str, str]], None]  # rung file, keys -> written into its metadata


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save(state: Path, ladder: Ladder) -> None:
    tmp = state.with_name(state.name + ".tmp")
    tmp.write_text(json.dumps(ladder.to_dict(), indent=2) + "\n")
    os.replace(tmp, state)


def run(source: Path, types: list[str], out_dir: Path, text: Path, steps: Steps, *, imatrix: str | None = "auto",
        calibration: Path | None = None, budget: float = DEFAULT_BUDGET,
        progress: Callable[[Step], None] | None = None) -> Ladder:
    """Build and measure every rung (resuming a ladder found in out_dir); returns the ladder."""
    report = progress or (lambda _s: None)

    def say(text: str) -> None:
        report(Step(text))

    if not types:
        raise UsageError("--ladder needs at least one type", "e.g. --ladder q8_0,q6_k,q4_k_m")
    out_dir.mkdir(parents=True, exist_ok=True)
    state = out_dir / STATE
    reference = _reference(source, out_dir, steps, say)
    previous = Ladder.from_dict(json.loads(state.read_text())) if state.exists() else None
    if previous is not None and (previous.reference != str(reference) or previous.text != str(text)):
        previous = None  # another reference or text: its measurements do not compare
    imatrix_path: Path | None = None
    dataset = None
    if imatrix not in (None, "none") and any(t in IMATRIX_HELPS for t in types):
        imatrix_path, dataset = _imatrix(reference, out_dir, imatrix, calibration, steps, say, previous)
    ladder = previous or Ladder(str(source), str(reference), 0.0, str(text),
                                str(imatrix_path) if imatrix_path else None, dataset, budget)
    ladder.budget = budget
    done = {r.type: r for r in ladder.rungs if Path(r.path).exists() and Path(r.path).stat().st_size == r.size}
    ladder.rungs = [done[t] for t in types if t in done]
    for i, t in enumerate(types):
        if t in done:
            report(Step("already built and measured", t, i + 1))
            continue
        rung, ppl_reference = _rung(t, source, reference, out_dir, text, imatrix_path, dataset, steps,
                                    functools.partial(_rung_step, report, t, i))
        ladder.rungs.append(rung)
        ladder.rungs.sort(key=lambda r: types.index(r.type))
        ladder.reference_ppl = ppl_reference
        _save(state, ladder)
    return ladder


def _rung_step(report: Callable[[Step], None], rung: str, done: int, text: str) -> None:
    report(Step(text, rung, done))


def _reference(source: Path, out_dir: Path, steps: Steps, say: Callable[[str], None]) -> Path:
    if source.is_dir():
        ref = out_dir / f"{source.name}-F16.gguf"
        if not ref.exists():
            say(f"converting {source} to F16")
            steps.convert(source, ref)
        return ref
    from localrun.gguf_header import read_gguf

    quant = (read_gguf(source).quantization or "").upper()
    if quant not in ("F32", "F16", "BF16", "ALL_F32", "MOSTLY_F16", "MOSTLY_BF16"):
        raise UsageError(f"the ladder needs a 16- or 32-bit source, and {source.name} is {quant or 'quantized'}",
                         "pass the Hugging Face checkpoint, or an F16/BF16 GGUF")
    return source


def _imatrix(reference: Path, out_dir: Path, imatrix: str, calibration: Path | None, steps: Steps,
             say: Callable[[str], None], previous: Ladder | None) -> tuple[Path, str]:
    if imatrix != "auto":
        path = Path(imatrix)
        if not path.is_file():
            raise UsageError(f"imatrix file {imatrix} does not exist", "pass --imatrix auto to compute one")
        return path, f"{path.name} (given)"
    path = out_dir / f"{reference.stem}.imatrix.gguf"
    if path.exists() and previous is not None and previous.imatrix == str(path) and previous.imatrix_dataset:
        return path, previous.imatrix_dataset
    say("computing the importance matrix")
    return path, steps.imatrix(reference, path, calibration)


def _rung(t: str, source: Path, reference: Path, out_dir: Path, text: Path, imatrix: Path | None,
          dataset: str | None, steps: Steps, say: Callable[[str], None]) -> tuple[Rung, float]:
    t0 = time.perf_counter()
    path = out_dir / f"{reference.stem.removesuffix('-F16')}-{t.upper()}.gguf"
    use = imatrix if t in IMATRIX_HELPS else None
    say("quantizing" + (" with the importance matrix" if use else ""))
    steps.quantize(reference, path, t, use)
    from importlib.metadata import version

    keys = {"localrun.source": str(source), "localrun.version": version("localrun"),
            "localrun.llama_cpp_python": version("llama-cpp-python"), "localrun.quantized_from": reference.name}
    if use is not None:
        keys["localrun.imatrix.dataset"] = dataset or ""
        keys["localrun.imatrix.sha256"] = sha256(use)
    steps.provenance(path, keys)
    say("evaluating against the reference")
    stats = steps.evaluate(path, reference, text)
    say("benchmarking")
    pp, tg = steps.bench(path)
    name = steps.register(path, t)
    from localrun.gguf_header import read_gguf

    meta = read_gguf(path)
    size = path.stat().st_size
    bpw = size * 8 / meta.parameters if meta.parameters else 0.0
    rung = Rung(t, str(path), size, round(bpw, 3), use is not None, stats["ppl"], stats["kld_mean"],
                stats["kld_median"], stats["kld_p99"], stats["kld_max"], stats["top_agreement"], stats["rms_dp"],
                pp, tg, name, round(time.perf_counter() - t0, 2))
    return rung, stats["ppl_reference"]


def default_text(max_chars: int = 60_000) -> tuple[str, str]:
    """A held-out evaluation text localrun builds itself, apart from the calibration set: the
    docstrings of a fixed list of Python standard-library modules (the same for the same Python).
    Returns (text, description)."""
    import importlib
    import sys

    from localrun.backends.llama_imatrix import (
        _CODE_MODULES,  # the calibration set's code: kept out
    )

    names = tuple(n for n in (
        "abc", "asyncio", "collections", "contextlib", "datetime", "decimal", "email", "enum", "http", "inspect",
        "itertools", "logging", "mailbox", "operator", "pathlib", "pickle", "queue", "random", "re", "sched",
        "shutil", "socket", "subprocess", "tarfile", "tempfile", "threading", "timeit", "typing", "unittest",
        "urllib", "uuid", "warnings", "wave", "weakref", "zipfile") if n not in _CODE_MODULES)
    parts: list[str] = []
    for n in names:
        try:
            mod = importlib.import_module(n)
        except Exception:  # noqa: BLE001 - a module this Python lacks is left out
            continue
        docs = [mod.__doc__ or ""] + [getattr(mod, a).__doc__ or "" for a in sorted(dir(mod))
                                        if not a.startswith("_") and callable(getattr(mod, a, None))]
        parts.extend(d.strip() for d in docs if isinstance(d, str) and len(d.strip()) > 200)
    text = "\n\n".join(dict.fromkeys(parts))[:max_chars]
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return text, (f"localrun-eval-v1 (docstrings of {len(names)} standard-library modules, Python "
                  f"{sys.version.split()[0]}; {len(text)} characters, sha256 {digest})")


def markdown(ladder: Ladder) -> str:
    """The report as a Markdown table, with the recommendation and what was measured how."""
    rec = ladder.recommended()
    lines = [f"# Quantization ladder: {Path(ladder.source).name}", "",
             f"Reference: `{Path(ladder.reference).name}` (perplexity {ladder.reference_ppl:.4f}); "
             f"text: `{Path(ladder.text).name}`; importance matrix: {ladder.imatrix_dataset or 'none'}.", "",
             "| type | size MiB | bpw | PPL | KLD mean | KLD p99 | top-1 agree | RMS Δp | pp t/s | tg t/s | imatrix |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in ladder.rungs:
        mark = " **(recommended)**" if rec is not None and r.type == rec.type else ""
        lines.append(f"| {r.type}{mark} | {r.size / 2**20:.1f} | {r.bits_per_weight:.2f} | {r.ppl:.4f} | "
                     f"{r.kld_mean:.5f} | {r.kld_p99:.5f} | {r.top_agreement * 100:.1f}% | {r.rms_dp * 100:.2f}% | "
                     f"{r.pp_tps:.1f} | {r.tg_tps:.1f} | {'yes' if r.imatrix else 'no'} |")
    lines.append("")
    lines.append(f"Recommended: **{rec.type}**, the smallest rung with mean KLD ≤ {ladder.budget}."
                 if rec else f"No rung has a mean KLD within {ladder.budget}; the budget can be raised with --max-kld.")
    return "\n".join(lines) + "\n"


def write_report(ladder: Ladder, out_dir: Path) -> tuple[Path, Path]:
    """report.md and report.json next to the files."""
    md, js = out_dir / "report.md", out_dir / "report.json"
    for path, text in ((md, markdown(ladder)), (js, json.dumps(ladder.to_dict(), indent=2) + "\n")):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return md, js


def add_metadata(path: Path, keys: dict[str, str]) -> None:
    """Write string keys into a GGUF's metadata (a new file beside it, then renamed over it)."""
    import functools

    import gguf
    import gguf.scripts.gguf_new_metadata as new_metadata
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    new_metadata.tqdm = functools.partial(new_metadata.tqdm, disable=True)  # its bar would go to stderr

    reader = gguf.GGUFReader(str(path))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch_name = str(bytes(arch.parts[arch.data[0]]), encoding="utf-8") if arch else "llama"
    tmp = path.with_name(path.name + ".meta.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=arch_name, endianess=reader.endianess)
    new = {k: MetadataDetails(gguf.GGUFValueType.STRING, v) for k, v in keys.items()}
    try:
        copy_with_new_metadata(reader, writer, new, [])
        del reader
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
