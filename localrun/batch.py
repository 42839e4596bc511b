"""Many prompts through one model at once: input rows, resume, output files, progress.

Input is JSONL ({"id", "prompt" | "messages", optional generation settings} per line) or plain
text (one prompt per line, ids are line numbers). The engine runs rows concurrently and hands
each back as it finishes; each is written and flushed at once, so a crash loses no finished row,
and --resume skips the ids already in the output. A bad row becomes {"id", "error"}.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, cast

from localrun import settings
from localrun.backends.base import Cancel, RowResult, Session
from localrun.errors import LocalrunError, StoreError, UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams
from localrun.system import disk_full

if TYPE_CHECKING:
    from localrun.adapters import Target
    from localrun.constraint import Constraint
    from localrun.tool_loop import ToolLoop
    from localrun.tools import ToolPlan

FORMATS = ("jsonl", "csv")
CSV_COLUMNS = ("id", "text", "thinking", "finish_reason", "prompt_tokens", "completion_tokens", "thinking_tokens",
               "error")
ROW_KEYS = ("id", "prompt", "messages", "system", "think", "images")
CONSTRAINT_KEYS = ("schema", "grammar", "choice", "format")  # a row's own structured output
# How a row's own settings (by field name, read by settings.py's table) and its own constraint, if
# any, become its GenerationParams: over the batch's, decided by settings.resolve (see `settle`).
Settle = Callable[[Mapping[str, Any], "Constraint | None"], GenerationParams]


def settle(given: Mapping[str, Any] | None = None, target: Target | None = None, engine: str | None = None,
           constraint: Constraint | None = None, tools: ToolPlan | None = None) -> Settle:
    """How the rows of one batch get their settings: a row's own over the batch's (`given`, the
    command's flags), over the preset's, the model's and localrun's; a row's own constraint in
    place of the batch's."""

    def settle_row(own: Mapping[str, Any], own_constraint: Constraint | None) -> GenerationParams:
        return settings.resolve(settings.layers(given, own), target, engine,
                                constraint=own_constraint or constraint, tools=tools)

    return settle_row


def settle_over(params: GenerationParams) -> Settle:
    """Rows' own settings over a whole GenerationParams (a library caller's)."""
    base = {k: v for k, v in params.to_dict().items() if k in settings.GENERATION}

    def settle_row(own: Mapping[str, Any], own_constraint: Constraint | None) -> GenerationParams:
        grammar = own_constraint.grammar if own_constraint is not None else None
        return GenerationParams(**{**params.to_dict(), **settings.layers(base, own),
                                   **({"grammar": grammar, "grammar_trigger": None} if grammar else {})})

    return settle_row


@dataclass(frozen=True)
class BatchRow:
    """One input row: what to generate (or why it cannot run) and its own settings, if any."""

    id: Any
    line: int
    request: Request | None = None
    params: GenerationParams | None = None  # None: the batch's settings
    error: str | None = None


class Record(TypedDict, total=False):
    """One output row as the JSONL file holds it: a reply, or why the row could not run."""

    id: Any  # the row's own id (any JSON value)
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str
    thinking: str  # a thinking model's thought, apart from text
    thinking_tokens: int
    drafted_tokens: int  # speculative decoding (--draft): tokens drafted, and kept
    accepted_tokens: int
    tool_uses: list[dict[str, Any]]  # the MCP calls the row's model made (batch --mcp)


@dataclass(frozen=True)
class Progress:
    """Where a running batch stands."""

    rows_done: int
    rows_total: int
    prompt_tokens: int
    completion_tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over wall time."""
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


class Meter:
    """Where a running batch stands, for its progress callback: rows done (bad rows first), tokens,
    time since it started. run_rows, run_rows_with_tools and the cluster's run keep it."""

    def __init__(self, rows: list[BatchRow], progress: Callable[[Progress], None] | None) -> None:
        self.t0 = time.perf_counter()
        self.total = len(rows)
        self.rows = rows
        self.progress = progress
        self.done = self.prompt = self.completion = 0

    def bad_rows(self) -> Iterator[Record]:
        """The rows that cannot run, as {"id", "error"}, counted done; then the first tick."""
        for r in self.rows:
            if r.error is not None:
                self.done += 1
                yield {"id": r.id, "error": r.error}
        self.tick()

    def finished(self, record: Mapping[str, Any]) -> None:
        """A row's record is out: one more row done, with its tokens."""
        self.done += 1
        self.prompt += int(record.get("prompt_tokens") or 0)
        self.completion += int(record.get("completion_tokens") or 0)

    def tick(self) -> None:
        if self.progress is not None:
            self.progress(Progress(self.done, self.total, self.prompt, self.completion, time.perf_counter() - self.t0))


def key(row_id: Any) -> str:
    """How ids are compared (CSV output reads every id back as text)."""
    return str(row_id)


# -- input ---------------------------------------------------------------------------------------


def _request(prompt: str | None, messages: Any, system: str | None, raw: bool,
             think: bool | str | None = None, images: Any = None, base: Path | None = None) -> Request:
    if prompt is not None:
        if not isinstance(prompt, str):
            raise UsageError("'prompt' must be a string")
        if not prompt.strip():
            raise UsageError("the prompt is empty")
        if raw:
            if images:
                raise UsageError("'images' need the chat template", "drop --raw")
            return Request.raw(prompt, system)
        user: dict[str, Any] = {"role": "user", "content": prompt}
        if images is not None:
            user["images"] = _images(images, base, "'images'")
        msgs = ([{"role": "system", "content": system}] if system else []) + [user]
        return Request.chat(msgs, think=think)
    if images is not None:
        raise UsageError("a row's 'images' go with its 'prompt'; in 'messages', give each message its own 'images'")
    if not isinstance(messages, list) or not messages:
        raise UsageError("'messages' must be a non-empty list of {role, content}")
    messages = [{**m, "images": _images(m["images"], base, f"message {i}: 'images'")}
                if isinstance(m, dict) and m.get("images") is not None else m for i, m in enumerate(messages)]
    if system and not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return Request.chat(messages, think=think)


def _images(value: Any, base: Path | None, what: str) -> list[bytes]:
    """A row's images: file paths (relative to the input file's folder), data URIs, or base64."""
    from localrun import images

    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{what} must be a list of image paths or data URIs")
    out = []
    for j, v in enumerate(value, 1):
        if v.startswith("data:"):
            out.append(images.from_base64(v, f"image {j}"))
            continue
        path = Path(v).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        try:
            found = path.is_file()
        except OSError:  # base64 text is too long for a file name
            found = False
        if found:
            out.append(images.read_file(path, f"image {j} ({v})"))
            continue
        try:
            out.append(images.from_base64(v, f"image {j}"))
        except UsageError:
            raise UsageError(f"image {j}: no such file: {path}",
                             "paths are relative to the input file; or give the image as base64") from None
    return out


def _settings(row: dict[str, Any], settle_row: Settle) -> GenerationParams | None:
    """The row's own settings and constraint over the batch's, or None when it has none."""
    own = {k: v for k, v in row.items() if k not in ROW_KEYS and k not in CONSTRAINT_KEYS}
    spec = {k: row[k] for k in CONSTRAINT_KEYS if row.get(k) is not None}
    if not own and not spec:
        return None
    given = settings.read(own, "batch", nulls=False)
    if spec:
        from localrun.constraint import Constraint

        return settle_row(given, Constraint.from_spec(spec, "row"))
    return settle_row(given, None)


_ID_IN_BROKEN_JSON = re.compile(r'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?\d+)')


def parse_row(data: Any, line: int, settle_row: Settle | None = None, system: str | None = None,
              raw: bool = False, think: bool | str | None = None, base: Path | None = None) -> BatchRow:
    """Validate one JSON row; a row that cannot run gets an error instead of a request."""
    settle_row = settle_row or settle()
    if not isinstance(data, dict):
        return BatchRow(line, line, error=f"line {line}: expected a JSON object with an id and a prompt or messages")
    row_id = data.get("id", line)
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        return BatchRow(line, line, error=f"line {line}: 'id' must be a string or an integer, not {row_id!r}")
    has_prompt, has_messages = data.get("prompt") is not None, data.get("messages") is not None
    if has_prompt == has_messages:
        what = "both 'prompt' and 'messages'" if has_prompt else "neither 'prompt' nor 'messages'"
        return BatchRow(row_id, line, error=f"line {line}: the row has {what}; give exactly one")
    row_system = data.get("system", system)
    try:
        if row_system is not None and not isinstance(row_system, str):
            raise UsageError("'system' must be a string")
        request = _request(data.get("prompt"), data.get("messages"), row_system, raw, data.get("think", think),
                           data.get("images"), base)
        params = _settings(data, settle_row)
    except LocalrunError as e:
        return BatchRow(row_id, line, error=f"line {line}: {e}")
    return BatchRow(row_id, line, request, params)


def refuse_thinking(rows: list[BatchRow], model: str) -> list[BatchRow]:
    """Rows that ask a model that cannot think to think get an error instead, as serve's 400 does."""
    return [replace(r, request=None, error=f"line {r.line}: model '{model}' does not support thinking; "
                                           "drop 'think' from the row, or use a model that thinks")
            if r.request is not None and r.request.think not in (None, False) else r for r in rows]


def parse_lines(lines: Iterable[str], fmt: str, settle_row: Settle, system: str | None = None,
                raw: bool = False, think: bool | str | None = None, base: Path | None = None) -> list[BatchRow]:
    """Rows from JSONL or text lines (blank lines skipped; text ids are 1-based line numbers)."""
    rows: list[BatchRow] = []
    for n, line in enumerate(lines, 1):
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if fmt == "text":
            rows.append(BatchRow(n, n, _request(text, None, system, raw, think)))
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            m = _ID_IN_BROKEN_JSON.search(text)
            try:
                row_id: Any = json.loads(m.group(1)) if m else n
            except ValueError:  # the id itself is broken too (a bad escape, a raw control character)
                row_id = n
            rows.append(BatchRow(row_id, n, error=f"line {n}: invalid JSON ({e.msg} at column {e.colno})"))
            continue
        rows.append(parse_row(data, n, settle_row, system, raw, think, base))
    seen: dict[str, int] = {}
    for r in rows:
        if r.request is None:
            continue
        first = seen.setdefault(key(r.id), r.line)
        if first != r.line:
            raise UsageError(f"id {r.id!r} appears on lines {first} and {r.line} of the input",
                             "ids must be unique, so that --resume can tell rows apart")
    return rows


def input_format(path: str, first_line: str) -> str:
    """'jsonl' or 'text', from the file name, else from the first non-blank line."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".txt", ".text", ".md"):
        return "text"
    return "jsonl" if first_line.lstrip().startswith("{") else "text"


def read_input(path: str, settle_row: Settle, system: str | None = None, raw: bool = False,
               think: bool | str | None = None) -> list[BatchRow]:
    """Read and validate every row of an input file ('-' reads stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"input file '{path}' does not exist", "pass a JSONL or text file with --input") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read input file '{path}': {e}") from e
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    base = Path.cwd() if path == "-" else Path(path).resolve().parent  # where rows' image paths start
    rows = parse_lines(lines, input_format(path, first), settle_row, system, raw, think, base)
    if not rows:
        raise UsageError(f"input file '{path}' has no rows", "write one JSON object or one prompt per line")
    return rows


def with_tools(rows: list[BatchRow], plan: Any) -> list[BatchRow]:
    """Rows with the tools in their prompts (their settings have the call grammar: `settle`); a raw
    row, which has no chat template to describe tools, becomes an error row."""
    import dataclasses

    out = []
    for r in rows:
        if r.request is None:
            out.append(r)
        elif r.request.prompt is not None:
            out.append(dataclasses.replace(r, request=None, error=f"line {r.line}: tools need a chat row, not --raw"))
        else:
            try:
                out.append(dataclasses.replace(r, request=plan.request(r.request.messages)))
            except LocalrunError as e:
                out.append(dataclasses.replace(r, request=None, error=f"line {r.line}: {e}"))
    return out


TEMPLATE_MARGIN = 256  # tokens a chat template may add around the messages (headers, default system prompts)


def sequence_length(rows: list[BatchRow], params: GenerationParams, limit: int) -> int:
    """Context tokens per sequence that every row fits in: an upper bound of its prompt (a token
    is at least one byte of text) plus its max_tokens, rounded up to 256, at most limit. A
    smaller context makes copying a shared prefix between sequences cheaper."""
    need = 0
    for r in rows:
        if r.request is None:
            continue
        budget = (r.params or params).max_tokens
        if budget is None or r.request.images:  # an image takes as many positions as its model gives it
            return limit
        text = r.request.prompt if r.request.prompt is not None else "".join(m.content for m in r.request.messages)
        text += json.dumps(list(r.request.tools)) if r.request.tools else ""
        need = max(need, len(text.encode("utf-8")) + TEMPLATE_MARGIN + budget)
    return min(limit, max(256, -(-need // 256) * 256))


# -- output --------------------------------------------------------------------------------------


def output_format(path: str, fmt: str | None) -> str:
    """The --format, or csv for a .csv output, else jsonl."""
    if fmt is not None:
        return fmt
    return "csv" if Path(path).suffix.lower() == ".csv" else "jsonl"


def finished_ids(path: str, fmt: str) -> set[str]:
    """Ids already in an output file; a row cut off by a crash is removed from the file."""
    p = Path(path)
    if not p.exists():
        return set()
    data = p.read_bytes().decode("utf-8", errors="replace")
    ids: set[str] = set()
    good = 0  # characters up to the end of the last complete row
    if fmt == "jsonl":
        for line in data.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            good += len(line)
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "id" in obj:
                ids.add(key(obj["id"]))
    else:
        lines = iter(data.splitlines(keepends=True))
        consumed = [0]

        def feed() -> Iterator[str]:
            for line in lines:
                consumed[0] += len(line)
                yield line

        reader = csv.reader(feed())
        try:
            for i, rec in enumerate(reader):
                if i == 0 and rec and rec[0] == "id" and tuple(rec) != CSV_COLUMNS:
                    raise UsageError(f"'{path}' has the columns {', '.join(rec)}; this localrun writes "
                                     f"{', '.join(CSV_COLUMNS)}", "write to a new file, or drop --resume")
                complete = data[:consumed[0]].endswith("\n") and len(rec) == len(CSV_COLUMNS)
                if not complete:
                    break
                good = consumed[0]
                if i > 0 or rec[0] != "id":
                    ids.add(rec[0])
        except csv.Error:
            pass
    if good < len(data):
        with open(p, "r+b") as f:
            f.truncate(len(data[:good].encode("utf-8")))
    return ids


class Writer:
    """Writes result records to a JSONL or CSV file (or stdout), each row in one unbuffered write.

    A row that cannot be written whole (a full disk) is cut off again, so the file always ends
    with its last complete row and --resume continues from there.
    """

    def __init__(self, path: str, fmt: str, append: bool) -> None:
        self.fmt, self.path = fmt, path
        self.f: io.FileIO | None = None  # None: stdout
        self.end = 0  # the file's length up to the end of its last complete row
        if path != "-":
            try:
                self.f = open(path, "ab" if append else "wb", buffering=0)  # noqa: SIM115 - closed in close()
            except OSError as e:
                raise UsageError(f"cannot write output file '{path}': {e.strerror or e}") from e
            self.end = self.f.seek(0, os.SEEK_END)
        if fmt == "csv" and self.end == 0:
            self._put(_csv_line(CSV_COLUMNS))

    def write(self, record: Mapping[str, Any]) -> None:
        if self.fmt == "csv":
            self._put(_csv_line("" if record.get(c) is None else record.get(c) for c in CSV_COLUMNS))
        else:
            self._put(json.dumps(record, ensure_ascii=False) + "\n")

    def _put(self, text: str) -> None:
        if self.f is None:
            try:
                sys.stdout.write(text)
                sys.stdout.flush()
            except BrokenPipeError:
                raise  # the reader went away: the CLI ends quietly
            except OSError as e:
                raise StoreError(f"cannot write the results to stdout: {e.strerror or e}") from e
            return
        data = text.encode("utf-8")
        done = 0
        try:
            while done < len(data):
                done += self.f.write(data[done:])  # a full disk can take part of a row first
        except OSError as e:
            raise self._error(e, self._cut()) from e
        self.end += len(data)

    def _cut(self) -> bool:
        """Truncate the file back to its last complete row; False if even that failed."""
        assert self.f is not None
        try:
            self.f.truncate(self.end)
        except OSError:
            return False
        return True

    def _error(self, e: OSError, cut: bool) -> StoreError:
        kept = "the rows finished before are kept" + ("" if cut else "; the last line is torn (--resume removes it)")
        if (full := disk_full(e, Path(self.path).resolve().parent)) is not None:
            disk, state = full
            return StoreError(f"cannot write output file '{self.path}': the disk at {disk} is {state}"
                              f" ({e.strerror}); {kept}",
                              f"free some space on {disk}, then run the same command with --resume to finish")
        return StoreError(f"cannot write output file '{self.path}': {e.strerror or e}; {kept}",
                          "run the same command with --resume once the file can be written")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def _csv_line(values: Iterable[Any]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(values)
    return buf.getvalue()


def check_output(path: str, resume: bool) -> None:
    """Refuse to overwrite a non-empty output unless resuming it."""
    if path == "-":
        if resume:
            raise UsageError("--resume needs an output file", "pass --output FILE")
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"output '{path}' is a folder", "pass a file name with --output")
    if not resume and p.exists() and p.stat().st_size > 0:
        raise UsageError(f"output file '{path}' already exists",
                         "pass --resume to continue it, or remove it to start over")
    if not p.parent.exists():
        raise UsageError(f"the folder of output file '{path}' does not exist")
    if resume and p.exists() and not os.access(p, os.W_OK):
        raise UsageError(f"cannot write output file '{path}'")


# -- running -------------------------------------------------------------------------------------


def _record(row: RowResult) -> Record:
    if row.error is not None:
        return {"id": row.id, "error": row.error}
    out: Record = {"id": row.id, "text": row.text, "finish_reason": row.finish_reason,
                   "prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens}
    if row.thinking or row.thinking_tokens:  # a thinking model's thought, apart from its text
        out["thinking"], out["thinking_tokens"] = row.thinking, row.thinking_tokens
    if row.drafted_tokens:
        out["drafted_tokens"], out["accepted_tokens"] = row.drafted_tokens, row.accepted_tokens
    return out


def run_rows(session: Session, rows: list[BatchRow], params: GenerationParams, cancel: Cancel | None = None,
             progress: Callable[[Progress], None] | None = None) -> Generator[Record, None, None]:
    """Run rows through a loaded session; yield a result record as each row finishes.

    Bad rows come first as {"id", "error"}; the others as {"id", "text", "finish_reason",
    "prompt_tokens", "completion_tokens"} in the order they finish.
    """
    meter = Meter(rows, progress)
    yield from meter.bad_rows()
    runnable = [(r.id, r.request, r.params or params) for r in rows if r.request is not None]
    if not runnable:
        return
    lines = {key(r.id): r.line for r in rows if r.request is not None}
    finished = 0  # tokens generated by finished rows; the engine's count includes running rows
    for event in session.generate_many(runnable, cancel):
        if isinstance(event, RowResult):
            rec = _record(event)
            if "error" in rec and key(rec["id"]) in lines:
                rec["error"] = f"line {lines[key(rec['id'])]}: {rec['error']}"
            running = meter.completion
            meter.finished(rec)
            finished += rec.get("completion_tokens", 0)
            meter.completion = max(running, finished)
            yield rec
        else:
            meter.completion = max(meter.completion, event.completion_tokens)
        meter.tick()


def run_rows_with_tools(session: Session, rows: list[BatchRow], params: GenerationParams, loop: ToolLoop,
                        plan_for: Callable[[str], ToolPlan], choice: str = "auto", cancel: Cancel | None = None,
                        progress: Callable[[Progress], None] | None = None) -> Generator[Record, None, None]:
    """Rows whose model may call MCP tools: every row replies at once (one generate_many per
    round); the calls of a round run as their rows finish, and those rows reply again with the
    results, until each answers or reaches the loop's step limit. Each record lists its calls
    (`tool_uses`). `plan_for(choice)` gives the tools held to a step's choice."""
    import dataclasses

    from localrun.chat import Message
    from localrun.tool_loop import Reply

    meter = Meter(rows, progress)
    yield from meter.bad_rows()
    state: dict[str, dict[str, Any]] = {
        key(r.id): {"row": r, "messages": list(r.request.messages), "uses": [], "step": 0, "tokens": [0, 0]}
        for r in rows if r.request is not None}
    active = list(state)
    while active and not (cancel is not None and cancel.is_set()):
        jobs = []
        plans: dict[str, ToolPlan] = {}
        for k in active:
            s = state[k]
            step_choice = "none" if s["step"] >= loop.max_steps else (choice if s["step"] == 0 else "auto")
            plan = plans[k] = plan_for(step_choice)
            request = dataclasses.replace(plan.request(s["messages"]), think=s["row"].request.think)
            grammar = plan.constraint()
            base = s["row"].params or params
            step_params = dataclasses.replace(base, grammar=grammar[0] if grammar else None,
                                              grammar_trigger=grammar[1] if grammar else None)
            jobs.append((s["row"].id, request, step_params))
        again: list[str] = []
        for event in session.generate_many(jobs, cancel):
            if not isinstance(event, RowResult):
                continue
            k = key(event.id)
            s = state[k]
            rec = _record(event)
            if "error" in rec:
                meter.finished({})
                yield {"id": s["row"].id, "error": f"line {s['row'].line}: {rec['error']}",
                       "tool_uses": [u.to_dict() for u in s["uses"]]}
                meter.tick()
                continue
            s["tokens"][0] += rec.get("prompt_tokens", 0)
            s["tokens"][1] += rec.get("completion_tokens", 0)
            reply = Reply.of(plans[k], event.text, thinking=event.thinking)
            if reply.calls:
                s["step"] += 1
                s["messages"].append(Message("assistant", reply.text, tuple(c.to_template() for c in reply.calls),
                                             thinking=event.thinking))
                for call in reply.calls:
                    use = loop.use(call)
                    s["uses"].append(use)
                    s["messages"].append(Message("tool", use.result, tool_call_id=call.id, name=call.name))
                again.append(k)
                continue
            out = {**rec, "text": reply.text, "prompt_tokens": s["tokens"][0], "completion_tokens": s["tokens"][1],
                   "tool_uses": [u.to_dict() for u in s["uses"]]}
            meter.finished(out)
            yield cast(Record, out)
            meter.tick()
        active = again
