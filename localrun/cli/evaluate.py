"""`localrun eval`: perplexity of a model on a text, and its KL divergence from a reference."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from localrun.cli.options import add_kv_type_flag, int_in, stderr_bar

if TYPE_CHECKING:
    from localrun.workbench.perplexity import EvalProgress


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity on a text; KL divergence against a reference model",
                       description=cmd_eval.__doc__)
    p.add_argument("model", help="model name (see 'localrun list') or path to a .gguf file")
    p.add_argument("--text", "-f", required=True, metavar="FILE", help="the text file to score (its bytes, as llama-perplexity -f reads them)")
    p.add_argument("--reference", "-r", metavar="MODEL",
                   help="a model with the same tokenizer (e.g. the F16 the model was quantized from)")
    p.add_argument("--ctx", "-c", type=int_in(8), default=512, metavar="N", help="tokens per chunk; the second half is scored (default 512)")
    p.add_argument("--chunks", type=int_in(1), metavar="N", help="score at most this many chunks (default: the whole text)")
    p.add_argument("--batch-size", "-b", type=int_in(1), default=2048, metavar="N",
                   help="tokens per llama_decode: batch-size/ctx chunks at once (default 2048)")
    p.add_argument("--threads", "-t", type=int_in(1), metavar="N", help="CPU threads (default: every core up to 4)")
    add_kv_type_flag(p)
    p.add_argument("--no-cache", action="store_true", help="recompute the reference's logits instead of reusing them")
    p.add_argument("--json", action="store_true", help="print one JSON object with every statistic")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """Score MODEL on the text of --text as llama.cpp's llama-perplexity does: chunks of --ctx
    tokens, each starting with BOS, the second half of each scored. With --reference, also the KL
    divergence of MODEL's next-token distributions from the reference's, how often their top
    tokens agree, and both perplexities; the reference's logits are computed once and cached.
    --kv-type sets MODEL's KV-cache type (the reference keeps f16: MODEL as its own reference
    measures what the cache type costs)."""
    from localrun import api

    bar = _Bar()
    try:
        result = api.evaluate(args.model, args.text, args.reference, n_ctx=args.ctx, chunks=args.chunks,
                              n_batch=args.batch_size, threads=args.threads, use_cache=not args.no_cache,
                              kv_type=args.kv_type, progress=bar.update)
    finally:
        bar.close()
    record = result.to_dict()
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(_report(record))
    return 0


def _report(r: dict[str, Any]) -> str:
    """The statistics as aligned 'name  value' lines, llama-perplexity's names and precision."""
    lines = [
        ("model", r["model"] + (f" (KV cache {r['kv_type']})" if r.get("kv_type", "f16") != "f16" else "")),
        ("text", f"{r['text']} ({r['chunks']} chunks of {r['n_ctx']} tokens, {r['tokens']} scored)"),
        ("PPL", f"{r['ppl']:.4f} ± {r['ppl_error']:.5f}"),
    ]
    d = r["divergence"]
    if d is not None:
        cached = "cached" if d["cache_hit"] else f"computed in {d['reference_seconds']:.1f} s, cached"
        lines += [
            ("reference", f"{d['reference']} ({cached})"),
            ("PPL(reference)", f"{d['ppl_reference']:.4f} ± {d['ppl_reference_error']:.5f}"),
            ("PPL ratio", f"{d['ppl_ratio']:.6f} ± {d['ppl_ratio_error']:.6f}"),
            ("ln PPL ratio", f"{d['ln_ppl_ratio']:.6f} ± {d['ln_ppl_ratio_error']:.6f}"),
            ("PPL difference", f"{d['ppl_diff']:.6f} ± {d['ppl_diff_error']:.6f}"),
            ("correlation", f"{100 * d['ppl_correlation']:.2f}% (ln PPL, per token)"),
            ("mean KLD", f"{d['kld_mean']:.6f} ± {d['kld_error']:.6f}"),
            ("median KLD", f"{d['kld_median']:.6f}"),
            ("KLD p90/p95/p99", f"{d['kld_p90']:.6f} / {d['kld_p95']:.6f} / {d['kld_p99']:.6f}"),
            ("KLD p99.9 / max", f"{d['kld_p999']:.6f} / {d['kld_max']:.6f}"),
            ("same top token", f"{100 * d['same_top']:.3f} ± {100 * d['same_top_error']:.3f} %"),
            ("RMS Δp", f"{100 * d['dp_rms']:.3f} ± {100 * d['dp_rms_error']:.3f} %"),
            ("mean Δp", f"{100 * d['dp_mean']:.3f} ± {100 * d['dp_mean_error']:.3f} %"),
            ("Δp max / min", f"{100 * d['dp_max']:.3f}% / {100 * d['dp_min']:.3f}%"),
        ]
    lines.append(("time", f"{r['seconds']:.1f} s"))
    return "\n".join(f"{k:<17}{v}" for k, v in lines)


class _Bar:
    """A rich bar on a terminal's stderr per pass (reference, then model); a line a chunk otherwise."""

    def __init__(self) -> None:
        self.tasks: dict[str, Any] = {}
        self.printed = 0.0
        self.bar: Any = stderr_bar("{task.description:<9}", "PPL {task.fields[ppl]}")

    def update(self, e: EvalProgress) -> None:
        if self.bar is None:
            now = time.monotonic()
            if now - self.printed >= 2.0 or e.chunk == e.chunks:
                self.printed = now
                print(f"localrun eval: {e.phase} {e.chunk}/{e.chunks} chunks, PPL {e.ppl:.4f}", file=sys.stderr, flush=True)
            return
        task = self.tasks.get(e.phase)
        if task is None:
            task = self.tasks[e.phase] = self.bar.add_task(e.phase, total=e.chunks, ppl="")
        self.bar.update(task, completed=e.chunk, ppl=f"{e.ppl:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
