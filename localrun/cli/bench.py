"""`localrun bench`: llama-bench's prompt (pp) and generation (tg) speed tests, same flags."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from localrun.workbench.bench import BenchRecord, BenchSpec

_RANGE = re.compile(r"^(-?\d+)(?:-(\d+)(?:([+*])(\d+))?)?$")
_TRUE, _FALSE, _AUTO = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0"), ("auto", "-1")


def int_list(low: int) -> Callable[[str], list[int]]:
    """An argparse type: llama-bench's number lists, '1,2', '1-4', '0-64+16' or '1-8*2', each >= low."""

    def parse(value: str) -> list[int]:
        out: list[int] = []
        for part in value.split(","):
            m = _RANGE.match(part.strip())
            if not m:
                raise argparse.ArgumentTypeError(f"expected numbers like 1,2 or 1-4, got {value!r}")
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) else first
            op, step = m.group(3) or "+", int(m.group(4) or 1)
            if (op == "+" and step < 1) or (op == "*" and (step < 2 or first < 1)) or last < first:
                raise argparse.ArgumentTypeError(f"invalid range {part!r}")
            n = first
            while n <= last:
                out.append(n)
                n = n + step if op == "+" else n * step
        if any(n < low for n in out):
            raise argparse.ArgumentTypeError(f"expected numbers >= {low}, got {value!r}")
        return out

    return parse


def _flash_attn_list(value: str) -> list[int]:
    out = []
    for v in value.split(","):
        v = v.strip().lower()
        if v not in _TRUE + _FALSE + _AUTO:
            raise argparse.ArgumentTypeError(f"expected on, off or auto (1, 0, -1), got {v!r}")
        out.append(1 if v in _TRUE else 0 if v in _FALSE else -1)
    return out


def _word_list(known: Iterable[str], flag: str) -> Callable[[str], list[str]]:
    def parse(value: str) -> list[str]:
        words = [w.strip().lower() for w in value.split(",")]
        bad = [w for w in words if w not in known]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {flag} value {bad[0]!r}; use one of {', '.join(known)}")
        return words

    return parse


def _pair_list(value: str) -> list[tuple[int, int]]:
    parts = value.split(",")
    if len(parts) % 2 or not all(p.strip().isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected PP,TG pairs of numbers, got {value!r}")
    nums = [int(p) for p in parts]
    return list(zip(nums[::2], nums[1::2], strict=True))


def register(sub: argparse._SubParsersAction) -> None:
    from localrun import api

    choices = api.bench_choices()
    p = sub.add_parser("bench", help="measure prompt and generation speed, as llama-bench does",
                       description=cmd_bench.__doc__)
    p.add_argument("models", nargs="+", metavar="MODEL", help="model names (see 'localrun list') or .gguf paths")
    t = p.add_argument_group("tests (comma-separated lists; each flag can repeat; the run is every combination)")
    add = t.add_argument
    add("-p", "--n-prompt", type=int_list(0), action="append", metavar="N", help="prompt tokens per pp test (default 512)")
    add("-n", "--n-gen", type=int_list(0), action="append", metavar="N", help="tokens per tg test (default 128)")
    add("-pg", type=_pair_list, action="append", metavar="PP,TG", help="a prompt then a generation, timed together")
    add("-b", "--batch-size", type=int_list(1), action="append", metavar="N", help="logical batch size (default 2048)")
    add("-ub", "--ubatch-size", type=int_list(1), action="append", metavar="N", help="physical batch size (default 512)")
    add("-ctk", "--cache-type-k", type=_word_list(choices.cache_types, "-ctk"), action="append", metavar="TYPE",
        help="K cache type (default f16)")
    add("-ctv", "--cache-type-v", type=_word_list(choices.cache_types, "-ctv"), action="append", metavar="TYPE",
        help="V cache type (default f16)")
    add("-t", "--threads", type=int_list(1), action="append", metavar="N", help="CPU threads (default: physical cores)")
    add("-ngl", "--n-gpu-layers", type=int_list(-1), action="append", metavar="N",
        help="layers offloaded to the GPU; -1: all (default; a list that starts with it: -ngl=-1,0)")
    add("-fa", "--flash-attn", type=_flash_attn_list, action="append", metavar="on|off|auto",
        help="flash attention (default auto)")
    add("-lm", "--load-mode", type=_word_list(choices.load_modes, "-lm"), action="append", metavar="MODE",
        help=f"how the weights are loaded: {', '.join(choices.load_modes)} (default auto)")
    add("-mmp", "--mmap", type=int_list(0), action="append", metavar="0|1", help="older llama-bench's -mmp: -lm none or mmap")
    r = p.add_argument_group("run")
    r.add_argument("-r", "--repetitions", type=int, default=5, metavar="N", help="repetitions of each test (default 5)")
    r.add_argument("--no-warmup", action="store_true", help="skip the warm-up run before each test")
    out = r.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_const", dest="output", const="md", help="a table (default)")
    out.add_argument("--json", action="store_const", dest="output", const="json",
                     help="a JSON list of records: every setting, samples_ns/samples_ts, avg_ts, stddev_ts")
    out.add_argument("--csv", action="store_const", dest="output", const="csv", help="CSV with a header line")
    p.set_defaults(func=cmd_bench, output="md")


def _flat(values: list[list[Any]] | None) -> tuple[Any, ...] | None:
    return None if values is None else tuple(v for vs in values for v in vs)


def spec_from_args(args: argparse.Namespace) -> BenchSpec:
    """The BenchSpec the flags ask for, with models resolved through the store."""
    from localrun import api
    from localrun.errors import UsageError

    if args.mmap is not None and args.load_mode is not None:
        raise UsageError("-mmp and -lm cannot be combined", "give -lm none or -lm mmap")
    if args.mmap is not None and any(v > 1 for vs in args.mmap for v in vs):
        raise UsageError("-mmp: expected 0 or 1")
    load_mode = _flat(args.load_mode)
    if args.mmap is not None:
        load_mode = tuple("mmap" if v else "none" for vs in args.mmap for v in vs)
    given = {"n_prompt": _flat(args.n_prompt), "n_gen": _flat(args.n_gen), "n_pg": _flat(args.pg),
             "n_batch": _flat(args.batch_size), "n_ubatch": _flat(args.ubatch_size), "type_k": _flat(args.cache_type_k),
             "type_v": _flat(args.cache_type_v), "n_threads": _flat(args.threads), "n_gpu_layers": _flat(args.n_gpu_layers),
             "flash_attn": _flat(args.flash_attn), "load_mode": load_mode}
    return api.bench_spec(args.models, repetitions=args.repetitions, warmup=not args.no_warmup,
                          **{k: v for k, v in given.items() if v is not None})


def cmd_bench(args: argparse.Namespace) -> int:
    """Measure prompt processing (pp: N random tokens in batches) and generation (tg: N tokens one
    at a time) of each MODEL, as llama-bench does: same tests, same settings, same timing, so the
    numbers compare with llama-bench's. The tests run in a child process; results go to stdout,
    progress to stderr."""
    from localrun import api

    spec = spec_from_args(args)
    printer: _Printer = {"md": _Markdown, "json": _Json, "csv": _Csv}[args.output](spec)
    progress = _Progress()
    try:
        for record in api.benchmark(spec, progress):
            progress.clear()
            printer.add(record)
    finally:
        progress.clear()
    printer.end()
    return 0


class _Progress:
    """Which test is running, on stderr: one line rewritten on a terminal, a line per test otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.last = ""
        self.shown = False

    def __call__(self, line: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r\x1b[K{line}")
            self.shown = True
        else:
            test = line.rpartition(": ")[0]  # "bench 2/4 (tg128, 'name', 2 threads)"
            if test != self.last:
                print(test, file=sys.stderr)
            self.last = test
        sys.stderr.flush()

    def clear(self) -> None:
        if self.shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
            self.shown = False


def _size(n: int) -> str:
    return f"{n / 1024**2:.2f} MiB" if n < 1024**3 else f"{n / 1024**3:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e6:.2f} M" if n < 1e9 else f"{n / 1e9:.2f} B"


class _Printer:
    """Writes records to stdout as they come (add), and whatever is left at the end (end)."""

    def __init__(self, spec: BenchSpec) -> None:
        self.spec = spec

    def add(self, r: BenchRecord) -> None:
        raise NotImplementedError

    def end(self) -> None:
        pass


class _Markdown(_Printer):
    """llama-bench's table: settings that vary or differ from the defaults get a column."""

    # (heading, width): negative widths align left, as llama-bench's printf does
    WIDTHS = {"model": ("model", -30), "size": ("size", 10), "params": ("params", 10), "backend": ("backend", -10),
              "n_gpu_layers": ("ngl", 3), "n_threads": ("threads", 7), "n_batch": ("n_batch", 7),
              "n_ubatch": ("n_ubatch", 8), "type_k": ("type_k", 6), "type_v": ("type_v", 6), "flash_attn": ("fa", 3),
              "load_mode": ("lm", 10), "test": ("test", 15), "t/s": ("t/s", 20)}

    def __init__(self, spec: BenchSpec) -> None:
        self.spec = spec
        default = type(spec)(models=spec.models)
        self.optional = [name for name in ("n_gpu_layers", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v",
                                           "flash_attn", "load_mode")
                         if getattr(spec, name) != getattr(default, name) or len(getattr(spec, name)) > 1]
        self.columns: list[tuple[str, int]] = []
        self.keys: list[str] = []

    def _header(self, backend: str) -> None:
        cpu = any(b in backend for b in ("CPU", "BLAS", "ZenDNN"))
        names = ["model", "size", "params", "backend"]
        names += [n for n in ("n_gpu_layers",) if not cpu or n in self.optional]
        names += [n for n in ("n_threads",) if cpu or n in self.optional]
        names += [n for n in self.optional if n not in ("n_gpu_layers", "n_threads")]
        self.columns = [self.WIDTHS[n] for n in [*names, "test", "t/s"]]
        self.keys = [*names, "test", "t/s"]
        self._row([h for h, _ in self.columns])
        print("|" + "".join(f" {'-' * (abs(w) - 1)}{':' if w > 0 else '-'} |" for _, w in self.columns))

    def _row(self, values: list[str]) -> None:
        cells = [f" {v:<{-w}} |" if w < 0 else f" {v:>{w}} |" for v, (_, w) in zip(values, self.columns, strict=True)]
        print("|" + "".join(cells), flush=True)

    def add(self, r: BenchRecord) -> None:
        if not self.columns:
            self._header(r.backend)
        c = r.case
        cell = {"model": c.model, "size": _size(r.model_size), "params": _params(r.model_n_params), "backend": r.backend,
                "test": r.test, "t/s": f"{r.avg_ts:.2f} ± {r.stddev_ts:.2f}"}
        self._row([cell[k] if k in cell else str(getattr(c, k)) for k in self.keys])


class _Json(_Printer):
    def __init__(self, spec: BenchSpec) -> None:
        super().__init__(spec)
        self.records: list[dict[str, Any]] = []

    def add(self, r: BenchRecord) -> None:
        self.records.append(r.to_dict())

    def end(self) -> None:
        import json

        print(json.dumps(self.records, indent=2))


class _Csv(_Printer):
    """llama-bench's CSV: one header line, then one line of scalar fields per test."""

    def __init__(self, spec: BenchSpec) -> None:
        import csv

        super().__init__(spec)
        self.writer = csv.writer(sys.stdout, lineterminator="\n")
        self.fields: list[str] | None = None

    def add(self, r: BenchRecord) -> None:
        d = r.to_dict()
        if self.fields is None:
            self.fields = [k for k, v in d.items() if not isinstance(v, list)]
            self.writer.writerow(self.fields)
        self.writer.writerow([d[k] for k in self.fields])
        sys.stdout.flush()
