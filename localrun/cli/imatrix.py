"""`localrun imatrix`: a GGUF model's importance matrix, for llama.cpp quantization (--imatrix)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from localrun.cli.options import int_in, stderr_bar
from localrun.errors import UsageError

if TYPE_CHECKING:
    from localrun.workbench.imatrix import ImatrixProgress


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("imatrix", help="compute an importance matrix for quantizing a GGUF model",
                       description=cmd_imatrix.__doc__)
    p.add_argument("model", metavar="MODEL", help="model name (see 'localrun list') or path to a .gguf file")
    p.add_argument("--calibration", "-f", metavar="FILE",
                   help="UTF-8 text to evaluate (default: localrun's built-in mix of prose, code and lists)")
    p.add_argument("-o", "--output", metavar="OUT", help="output .gguf (default: ./MODEL.imatrix.gguf)")
    p.add_argument("--ctx", type=int_in(16), default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int_in(1), metavar="N", help="evaluate at most N chunks (default: all)")
    p.add_argument("--threads", type=int_in(1), metavar="N", help="CPU threads (default: every core up to 4)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.set_defaults(func=cmd_imatrix)


def cmd_imatrix(args: argparse.Namespace) -> int:
    """Evaluate calibration text with MODEL on llama.cpp and write its importance matrix: per
    weight matrix, the sum of each input column's squared activations and the token count, in
    llama-imatrix's GGUF format. Pass it to 'localrun quantize IN TYPE --imatrix OUT' (needed by
    iq1/iq2 types and q2_k_s, and better quality for every low-bit type). The path is printed."""
    from localrun import api

    model = api.get_model(args.model)
    if model.format != "gguf":
        raise UsageError(f"model '{model.name}' is {model.format}, and importance matrices are for GGUF",
                         "pass a .gguf model")
    out = Path(args.output) if args.output else Path(f"{Path(model.path).stem}.imatrix.gguf")
    if out.suffix != ".gguf":
        raise UsageError(f"output {out} should end in .gguf", "llama.cpp reads importance matrices from GGUF files")
    if out.exists() and not args.force:
        raise UsageError(f"{out} already exists", "pass --force to overwrite it, or choose another -o")
    if not out.parent.is_dir():
        raise UsageError(f"folder {out.parent} does not exist", "create it or choose another -o")
    with _Bar() as bar:
        summary = api.compute_imatrix(model.path, args.calibration, out, n_ctx=args.ctx, chunks=args.chunks,
                                      threads=args.threads, progress=bar.update, dataset=args.calibration)
    ppl = f", perplexity {summary.perplexity:.4f}" if summary.perplexity else ""
    print(f"wrote {summary.path}: {summary.tensors} weight matrices from {summary.chunks} chunks of "
          f"{summary.chunk_size} tokens in {summary.seconds:.1f}s{ppl}", file=sys.stderr)
    print(summary.path)
    return 0


class _Bar:
    """A rich progress bar on a terminal; on a pipe, a line every few seconds."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.task: Any = None
        self.printed = 0.0

    def __enter__(self) -> _Bar:
        self.bar = stderr_bar("chunks", "{task.fields[speed]}")
        if self.bar is not None:
            self.task = self.bar.add_task("chunks", total=None, speed="")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, p: ImatrixProgress) -> None:
        speed = f"{p.tokens / p.elapsed_s:.0f} tok/s" if p.elapsed_s > 0 else ""
        if self.bar is not None:
            self.bar.update(self.task, completed=p.chunk, total=p.chunks, speed=speed)
            return
        now = time.monotonic()
        if now - self.printed >= 5 or p.chunk == p.chunks:
            self.printed = now
            print(f"localrun imatrix: {p.chunk}/{p.chunks} chunks, {speed}", file=sys.stderr, flush=True)
