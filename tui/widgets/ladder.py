"""The quantization ladder's results: a table of the rungs and a plot of size against mean KLD."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from rich.style import Style
from rich.text import Text
from textual.widget import Widget
from textual.widgets import DataTable

MARK = "★"  # the recommended rung, in the table and the plot
DOT = "●"
BUDGET = "┄"


class Point(NamedTuple):
    """One rung on the plot."""

    label: str
    x: float  # size in MiB
    y: float  # mean KLD
    recommended: bool = False


def points(ladder: Any) -> list[Point]:
    """The plot's points of a localrun.workbench.ladder.Ladder."""
    rec = ladder.recommended()
    return [Point(r.type, r.size / 2**20, r.kld_mean, rec is not None and r.type == rec.type) for r in ladder.rungs]


class Canvas:
    """A grid of characters, each with a role (how it is styled); later writes win."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.cells = [[(" ", "")] * width for _ in range(height)]

    def put(self, row: int, col: int, text: str, role: str = "") -> None:
        if not 0 <= row < self.height:
            return
        for i, ch in enumerate(text):
            if 0 <= col + i < self.width:
                self.cells[row][col + i] = (ch, role)

    def free(self, row: int, col: int, n: int, ignore: tuple[str, ...] = ("", "budget")) -> bool:
        """Whether n cells from (row, col) are inside and hold nothing but background roles."""
        if not (0 <= row < self.height and 0 <= col and col + n <= self.width):
            return False
        return all(self.cells[row][c][1] in ignore for c in range(col, col + n))

    def lines(self) -> list[str]:
        return ["".join(ch for ch, _ in row) for row in self.cells]


def nice_step(span: float, n: int) -> float:
    """The step of 1, 2 or 5 times a power of ten nearest to cutting `span` into n parts."""
    raw = span / max(n, 1)
    if raw <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    return min((m * power for m in (1, 2, 5, 10)), key=lambda step: abs(math.log(step / raw)))


class Axis:
    """A linear or log10 mapping of values onto 0..1, with tick values."""

    def __init__(self, lo: float, hi: float, log: bool = False) -> None:
        self.lo, self.hi, self.log = lo, hi, log

    def _t(self, v: float) -> float:
        return math.log10(v) if self.log else v

    def frac(self, v: float) -> float:
        lo, hi = self._t(self.lo), self._t(self.hi)
        return 0.5 if hi == lo else (self._t(v) - lo) / (hi - lo)

    def ticks(self, n: int) -> list[float]:
        """Decades on a log axis; multiples of a nice step inside the range on a linear one."""
        if self.log:
            first, last = round(math.log10(self.lo)), round(math.log10(self.hi))
            return [10.0**e for e in range(first, last + 1)]
        step = nice_step(self.hi - self.lo, n)
        first = math.ceil(self.lo / step - 1e-9)
        return [k * step for k in range(first, math.floor(self.hi / step + 1e-9) + 1)]

    def label(self, v: float, n: int) -> str:
        """A tick value with the digits its step needs (ticks(n) made the step)."""
        if self.log:
            return f"{v:g}"
        step = nice_step(self.hi - self.lo, n)
        digits = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
        return f"{v:.{digits}f}"


def _y_axis(ys: list[float], budget: float | None) -> Axis:
    """Log when every KLD is positive and they span a decade or more (a ladder usually does);
    otherwise linear from 0. The budget is in range when it is near the data."""
    near = [budget] if budget is not None and budget > 0 else []
    if ys and min(ys) > 0 and max(ys) / min(ys) >= 10:
        values = ys + [b for b in near if min(ys) / 10 <= b <= max(ys) * 10]
        return Axis(10.0 ** math.floor(math.log10(min(values))), 10.0 ** math.ceil(math.log10(max(values))), True)
    top = max(ys, default=0.0)
    if near and (top == 0 or near[0] <= 2 * top):
        top = max(top, near[0])
    top = top or 1.0
    step = nice_step(top, 4)
    return Axis(0.0, step * math.ceil(top * 1.05 / step))


def _x_axis(xs: list[float]) -> Axis:
    lo, hi = min(xs, default=0.0), max(xs, default=1.0)
    span = hi - lo if hi > lo else max(abs(lo) * 0.2, 0.1)
    pad = span * 0.1
    return Axis(max(0.0, lo - pad), hi + pad)


def draw(pts: Iterable[Point], width: int, height: int, budget: float | None = None) -> Canvas:
    """Size (x) against mean KLD (y): a marker and its label per point, axes with tick labels, a
    dashed line at the KLD budget, and a one-line legend at the bottom."""
    pts = list(pts)
    canvas = Canvas(width, height)
    rows = height - 3  # x axis, its tick labels, the legend
    ys_axis = _y_axis([p.y for p in pts], budget)
    n_y = 2 if rows < 6 else 4
    y_ticks = ys_axis.ticks(n_y)
    y_labels = [ys_axis.label(v, n_y) for v in y_ticks]
    left = max((len(s) for s in y_labels), default=1)
    cols = width - left - 2  # the axis and a margin on the right
    if rows < 3 or cols < 16:
        canvas.put(0, 0, "(too small for the plot)"[:width], "axis")
        return canvas

    def row_of(v: float) -> int:
        return round((1 - ys_axis.frac(v)) * (rows - 1))

    xs_axis = _x_axis([p.x for p in pts])

    def col_of(v: float) -> int:
        return left + 1 + round(xs_axis.frac(v) * (cols - 1))

    for r in range(rows):
        canvas.put(r, left, "│", "axis")
    labelled: set[int] = set()
    for v, s in zip(y_ticks, y_labels, strict=True):
        r = row_of(v)
        if r in labelled:  # more ticks than rows: the first on a row keeps it
            continue
        labelled.add(r)
        canvas.put(r, left - len(s), s, "axis")
        canvas.put(r, left, "┤", "axis")
    canvas.put(rows, left, "└" + "─" * cols, "axis")
    n_x = max(2, min(6, cols // 12))
    taken = -1
    for v in xs_axis.ticks(n_x):
        c = col_of(v)
        canvas.put(rows, c, "┬", "axis")
        s = xs_axis.label(v, n_x)
        start = min(max(c - len(s) // 2, 0), width - len(s))
        if start > taken:
            canvas.put(rows + 1, start, s, "axis")
            taken = start + len(s)
    if budget is not None and ys_axis.lo <= budget <= ys_axis.hi and (not ys_axis.log or budget > 0):
        canvas.put(row_of(budget), left + 1, BUDGET * cols, "budget")
    cells: dict[tuple[int, int], list[Point]] = {}  # rungs of the same size and KLD share a marker
    for p in pts:
        cells.setdefault((row_of(p.y), col_of(p.x)), []).append(p)
    for (r, c), group in cells.items():  # markers first, so that no label covers another rung's marker
        rec = any(p.recommended for p in group)
        canvas.put(r, c, MARK if rec else DOT, "recommended" if rec else "point")
    for (r, c), group in cells.items():
        group.sort(key=lambda p: not p.recommended)
        _label(canvas, r, c, "/".join(p.label for p in group), group[0].recommended, left + 1)
    legend = f"x: size (MiB)   y: mean KLD{' (log)' if ys_axis.log else ''}   {MARK} recommended"
    if budget is not None:
        legend += f"   {BUDGET * 2} budget {budget:g}"
    canvas.put(height - 1, 0, legend[:width], "axis")
    return canvas


def _label(canvas: Canvas, row: int, col: int, text: str, recommended: bool, inner: int) -> None:
    """A label beside its marker, a blank cell from anything else: right, left, then the rows
    above and below; where nothing is free, on the right regardless."""
    role = "recommended" if recommended else "point"
    n = len(text)
    # (row, where the label starts, where the free run it needs starts)
    for r, c, free_from in ((row, col + 2, col + 2), (row, col - n - 1, col - n - 2), (row - 1, col + 1, col + 1),
                            (row + 1, col + 1, col + 1), (row - 1, col - n, col - n - 1),
                            (row + 1, col - n, col - n - 1)):
        if c >= inner and free_from >= inner and r < canvas.height - 3 and canvas.free(r, free_from, n + 1):
            canvas.put(r, c, text, role)
            return
    canvas.put(row, min(col + 2, canvas.width - n), text, role)


class LadderPlot(Widget):
    """The ladder's rungs as points of size against mean KLD, redrawn at the widget's size."""

    COMPONENT_CLASSES = {"ladder-plot--axis", "ladder-plot--point", "ladder-plot--recommended",
                         "ladder-plot--budget"}
    DEFAULT_CSS = """
    LadderPlot { height: 1fr; }
    LadderPlot > .ladder-plot--axis { color: $text-muted; }
    LadderPlot > .ladder-plot--point { color: $accent; text-style: bold; }
    LadderPlot > .ladder-plot--recommended { color: $success; text-style: bold; }
    LadderPlot > .ladder-plot--budget { color: $warning; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.points: list[Point] = []
        self.budget: float | None = None
        self.drawn: list[str] = []  # the lines last rendered (what tests read)

    def show(self, ladder: Any) -> None:
        """Plot the rungs of a localrun.workbench.ladder.Ladder."""
        self.points = points(ladder)
        self.budget = ladder.budget
        self.refresh()

    def render(self) -> Text:
        if not self.points:
            self.drawn = []
            return Text("Run a ladder to plot its rungs.", style=self.get_component_rich_style("ladder-plot--axis"))
        canvas = draw(self.points, self.size.width, self.size.height, self.budget)
        self.drawn = canvas.lines()
        styles = {role: self.get_component_rich_style(f"ladder-plot--{role}")
                  for role in ("axis", "point", "recommended", "budget")}
        out = Text(no_wrap=True, overflow="crop")
        for i, row in enumerate(canvas.cells):
            if i:
                out.append("\n")
            for ch, role in row:
                out.append(ch, styles.get(role, Style.null()))
        return out


COLUMNS = ("type", "MiB", "bpw", "PPL", "KLD mean", "top-1", "pp t/s", "tg t/s")


def fill_table(table: DataTable[Any], ladder: Any) -> None:
    """One row per rung, numbers right-aligned; the recommended rung's type carries MARK."""
    table.clear(columns=True)
    table.add_columns(*COLUMNS)
    rec = ladder.recommended()
    for r in ladder.rungs:
        mark = f"{MARK} " if rec is not None and r.type == rec.type else "  "
        cells = (f"{r.size / 2**20:.1f}", f"{r.bits_per_weight:.2f}", f"{r.ppl:.3f}", f"{r.kld_mean:.5f}",
                 f"{r.top_agreement * 100:.1f}%", f"{r.pp_tps:.0f}", f"{r.tg_tps:.0f}")
        table.add_row(Text(mark + r.type), *(Text(c, justify="right") for c in cells), key=r.type)
