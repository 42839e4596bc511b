"""The README's "Reliability" table, counted by the tests themselves as they run.

Each fault test calls `fault(kind, where)` once its assertions have passed (the fault was
injected and survived; a client that left counts when it was seen leaving mid-stream and its
cancellation was asserted, not when it was planned), each fuzzing test calls `inputs(kind)` for
every bad input it tried and saw answered, and the tests that interrupt a batch call
`rows(total, lost)`. Every count is fixed by the tests themselves (not by how far a run got before
its fault): the soak's leavers, for one, come back after a refusal until each has left mid-stream,
so a rerun writes the same table. When the whole suite has run and passed under `make test`
(LOCALRUN_RELIABILITY_README=1), the table between the README's reliability markers is rewritten
from these counts; no figure in it is typed by hand.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN = "<!-- reliability:begin -->"
END = "<!-- reliability:end -->"
ENV = "LOCALRUN_RELIABILITY_README"

# The table's rows, in order: (kind, what the row promises). A kind that no test recorded means
# the run was partial, and the table is left as it was.
FAULTS = {  # kind: (what was done, what every case showed)
    "SIGKILL": ("killed with SIGKILL",
                "an error where the user is, nothing partial registered, the next run works or resumes"),
    "full disk": ("a full disk", "one error naming the disk, nothing half-written registered, the next run completes"),
    "damaged file": ("a damaged or truncated file",
                     "restored from the kept copy or an error naming the file, never an empty library"),
    "misbehaving Hub": ("a Hub that misbehaves", "resumed, retried or refused clearly, never a corrupt file installed"),
    "dropped client": ("a client that left mid-stream",
                       "seen leaving after its first streamed text and cancelled; the server serves on and frees every"
                       " sequence"),
}
INPUTS = {
    "GGUF header": "GGUF headers (one field mutated, or bytes cut and flipped)",
    "batch row": "batch inputs (one row, a set of lines, an input file)",
    "server request": "server requests (every endpoint from its OpenAPI schema, malformed bodies)",
    "chat template": "chat templates (injection payloads, endless loops, huge strings)",
}
LOAD = {  # kind: (what was sent, what every one showed) - well-formed requests, not bad input
    "soak request": ("well-formed requests from 64 concurrent clients (the soak: chat, completions, embeddings, "
                     "streamed or not)", "answered, or refused with a 503 in its API's shape when the queue was "
                                         "full; none hung, no 500"),
}


@dataclass
class Tally:
    faults: Counter[str] = field(default_factory=Counter)
    places: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    inputs: Counter[str] = field(default_factory=Counter)
    rows_total: int = 0
    rows_lost: int = 0
    interruptions: int = 0


TALLY = Tally()


def fault(kind: str, where: str, n: int = 1) -> None:
    """n faults of `kind` were injected into `where` and survived (call after the assertions)."""
    assert kind in FAULTS, kind
    TALLY.faults[kind] += n
    TALLY.places[kind].add(where)


def inputs(kind: str, n: int = 1) -> None:
    """n bad inputs of `kind` were tried and each was answered (a clear error, no crash); or, for
    a kind of LOAD, n well-formed requests under load were each answered or refused cleanly."""
    assert kind in INPUTS or kind in LOAD, kind
    TALLY.inputs[kind] += n


def rows(total: int, lost: int) -> None:
    """A batch of `total` rows was interrupted and resumed; `lost` rows finished before are missing."""
    TALLY.interruptions += 1
    TALLY.rows_total += total
    TALLY.rows_lost += lost


def table(t: Tally = TALLY) -> str:
    """The markdown table of a tally."""
    lines = ["| What the tests did | Times | Outcome |", "|---|---:|---|"]
    for kind, (what, outcome) in FAULTS.items():
        n = t.faults[kind]
        places = ", ".join(sorted(t.places[kind]))
        lines.append(f"| Fault: {what} ({places}) | {n} | all {n}: {outcome} |")
    for kind, what in INPUTS.items():
        n = t.inputs[kind]
        lines.append(f"| Bad input: {what} | {n} | all {n} answered: accepted, or a clear error; no crash, no 500 |")
    for kind, (what, outcome) in LOAD.items():
        n = t.inputs[kind]
        lines.append(f"| Load: {what} | {n} | all {n} {outcome} |")
    lines.append(f"| Rows of {t.interruptions} batches interrupted and resumed | {t.rows_total} |"
                 f" rows lost: {t.rows_lost} |")
    return "\n".join(lines)


def missing(t: Tally = TALLY) -> list[str]:
    """The rows no test recorded (a partial run)."""
    gone = [k for k in FAULTS if not t.faults[k]] + [k for k in (*INPUTS, *LOAD) if not t.inputs[k]]
    return gone + ([] if t.interruptions else ["interrupted batch"])


def update_readme(text: str, t: Tally = TALLY) -> str:
    """README text with the table between the markers replaced."""
    head, sep, rest = text.partition(BEGIN)
    body, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"README.md has no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{table(t)}\n{END}{tail}"


def finish(passed: bool) -> str | None:
    """At the end of the session: rewrite the README table if asked and the run was whole."""
    if os.environ.get(ENV, "") in ("", "0"):
        return None
    if not passed:
        return "reliability table not updated: the run failed"
    if gone := missing():
        return f"reliability table not updated: a partial run (nothing recorded for {', '.join(gone)})"
    old = README.read_text(encoding="utf-8")
    new = update_readme(old)
    if new != old:
        README.write_text(new, encoding="utf-8")
        return "reliability table in README.md updated from this run"
    return "reliability table in README.md is current"
