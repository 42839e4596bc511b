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

from localrun.errors import ConversionError, UsageError

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
    """What the ladder calls for each step (the real ones from measuring_steps; tests may wrap them)."""

    convert: Callable[[Path, Path], Path]  # source checkpoint -> F16 GGUF
    imatrix: Callable[[Path, Path, Path | None], str]  # reference, out, calibration -> dataset description
    quantize: Callable[[Path, Path, str, Path | None], None]  # reference, out, type, imatrix
    evaluate: Callable[[Path, Path, Path], dict[str, float]]  # rung, reference, text -> statistics (+ ppl_reference)
    bench: Callable[[Path], tuple[float, float]]  # rung -> (pp tokens/s, tg tokens/s)
    register: Callable[[Path, str], str]  # rung file, type -> store name
    provenance: Callable[[Path, dict[str, str]], None]  # rung file, keys -> written into its metadata


Progress = Callable[[Step], None]


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


def measuring_steps(convert: Callable[[Path, Path], Path], register: Callable[[Path, str], str], *, n_ctx: int = 512,
                    chunks: int | None = None, bench: tuple[int, int, int] = (512, 128, 3),
                    threads: int | None = None) -> Steps:
    """The real steps: llama.cpp quantizes, the workbench evaluates, benchmarks and computes the
    importance matrix (each in a child process); converting and registering are the caller's."""
    pp, tg, reps = bench

    def quantize(ref: Path, dst: Path, t: str, im: Path | None) -> None:
        import convert as converter

        try:
            converter.quantize(ref, dst, t, imatrix=im, force=True, threads=threads)
        except converter.ConvertError as e:
            raise ConversionError(e.message, e.hint) from e

    def evaluate(rung: Path, ref: Path, txt: Path) -> dict[str, float]:
        from localrun.workbench.perplexity import evaluate_in_worker

        r = evaluate_in_worker(rung, txt, ref, n_ctx=n_ctx, chunks=chunks, threads=threads)
        d = r.divergence
        assert d is not None
        return {"ppl": r.ppl, "ppl_reference": d.ppl_reference, "kld_mean": d.kld_mean, "kld_median": d.kld_median,
                "kld_p99": d.kld_p99, "kld_max": d.kld_max, "top_agreement": d.same_top, "rms_dp": d.dp_rms}

    def measure_speed(rung: Path) -> tuple[float, float]:
        from localrun.workbench.bench import BenchSpec, run_bench_isolated, summary

        kw: dict[str, Any] = {"n_threads": (threads,)} if threads else {}
        spec = BenchSpec(models=(str(rung),), n_prompt=(pp,), n_gen=(tg,), repetitions=reps, **kw)
        s = summary(run_bench_isolated(spec))
        return s.get(f"pp{pp}", 0.0), s.get(f"tg{tg}", 0.0)

    def imatrix(ref: Path, dst: Path, calibration: Path | None) -> str:
        from localrun.workbench.imatrix import compute_imatrix

        return compute_imatrix(ref, calibration, dst, threads=threads).dataset

    return Steps(convert=convert, imatrix=imatrix, quantize=quantize, evaluate=evaluate, bench=measure_speed,
                 register=register, provenance=add_metadata)


def evaluation_text(out_dir: Path, text: str | os.PathLike[str] | None,
                    progress: Callable[[Step], None] | None = None) -> Path:
    """The text the rungs are scored on: the given file, or localrun's held-out set written to out_dir."""
    if text is not None:
        return Path(text)
    from localrun.workbench.texts import default_text

    body, description = default_text()
    path = out_dir / "eval-text.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != body:
        path.write_text(body, encoding="utf-8")
    if progress:
        progress(Step(f"evaluation text: {description}"))
    return path


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
