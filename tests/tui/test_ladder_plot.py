"""The ladder's plot drawn on a character grid: where points, labels, axes and the budget go."""

from __future__ import annotations

from types import SimpleNamespace

from tui.screens.convert import ladder_types
from tui.widgets.ladder import DOT, MARK, Point, draw, nice_step, points


def where(lines: list[str], text: str) -> tuple[int, int]:
    (found,) = [(r, line.index(text)) for r, line in enumerate(lines) if text in line]
    return found


LADDER = [Point("q8_0", 700.0, 0.0017, True), Point("q6_k", 560.0, 0.005), Point("q4_k_m", 380.0, 0.03),
          Point("q2_k", 250.0, 0.5)]


def test_points_go_right_with_size_and_up_with_kld() -> None:
    lines = draw(LADDER, 78, 12, budget=0.05).lines()
    spots = [where(lines, p.label) for p in LADDER]
    assert [c for _, c in spots] == sorted((c for _, c in spots), reverse=True)  # size falls down the ladder
    assert [r for r, _ in spots] == sorted((r for r, _ in spots), reverse=True)  # KLD rises down the ladder
    r, c = where(lines, "q8_0")
    assert lines[r][c - 2] == MARK and lines[where(lines, "q2_k")[0]].count(DOT) == 1


def test_kld_spanning_decades_is_drawn_on_a_log_axis_with_the_budget() -> None:
    lines = draw(LADDER, 78, 12, budget=0.05).lines()
    labels = [line.split("┤")[0].strip() for line in lines if "┤" in line]
    assert labels == ["1", "0.1", "0.01", "0.001"]
    assert "(log)" in lines[-1] and "budget 0.05" in lines[-1]
    budget_row, _ = where(lines, "┄┄┄┄")
    assert where(lines, "q2_k")[0] < budget_row < where(lines, "q4_k_m")[0]


def test_close_kld_is_linear_from_zero_and_x_ticks_are_round() -> None:
    lines = draw([Point("a", 4000.0, 0.01), Point("b", 7000.0, 0.03)], 78, 12).lines()
    labels = [line.split("┤")[0].strip() for line in lines if "┤" in line]
    assert labels[-1] == "0.00" and "(log)" not in lines[-1]
    ticks = lines[-2].split()
    assert ticks == [str(4000 + 500 * i) for i in range(7)]


def test_rungs_in_the_same_cell_share_one_marker_and_label() -> None:
    lines = draw([Point("q8_0", 0.4, 0.002, True), Point("q6_k", 0.4, 0.002), Point("q4_0", 0.3, 0.2)], 60, 10).lines()
    r, c = where(lines, "q8_0/q6_k")
    assert MARK in lines[r] and DOT not in lines[r]


def test_labels_stay_inside_and_never_cover_markers() -> None:
    crowd = [Point(f"t{i}", 1.0 + i * 0.01, 0.1, i == 0) for i in range(5)]
    lines = draw(crowd, 40, 10).lines()
    assert all(len(line) == 40 for line in lines)
    assert sum(line.count(DOT) + line.count(MARK) for line in lines[:-1]) == 5  # the legend has a MARK
    assert all(any(p.label in line for line in lines) for p in crowd)


def test_a_small_area_says_so() -> None:
    assert draw(LADDER, 20, 4).lines()[0].startswith("(too small")


def test_points_of_a_ladder_mark_its_recommendation() -> None:
    rung = SimpleNamespace
    ladder = SimpleNamespace(rungs=[rung(type="q8_0", size=2**21, kld_mean=0.001),
                                    rung(type="q4_0", size=2**20, kld_mean=0.2)],
                             recommended=lambda: ladder.rungs[0])
    assert points(ladder) == [Point("q8_0", 2.0, 0.001, True), Point("q4_0", 1.0, 0.2, False)]


def test_nice_steps_and_ladder_types() -> None:
    assert [nice_step(s, 4) for s in (540.0, 0.12, 3.0)] == [100.0, 0.02, 1.0]
    assert ladder_types(" q8_0, Q4_K_M,, ") == ["q8_0", "q4_k_m"]
