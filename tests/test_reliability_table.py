"""The README's reliability table is generated: its section is there, and the generator fills it
from counts, every category included, without touching the rest of the README."""

from __future__ import annotations

from . import reliability
from .reliability import BEGIN, END, README, Tally


def _tally() -> Tally:
    t = Tally()
    for kind in reliability.FAULTS:
        t.faults[kind] += 2
        t.places[kind].update({"b place", "a place"})
    for kind in (*reliability.INPUTS, *reliability.LOAD):
        t.inputs[kind] += 7
    t.rows_total, t.rows_lost, t.interruptions = 40, 0, 3
    return t


def test_readme_has_the_generated_section() -> None:
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1 and text.index(BEGIN) < text.index(END)


def test_the_table_comes_from_the_counts() -> None:
    t = _tally()
    table = reliability.table(t)
    rows = table.splitlines()[2:]
    assert len(rows) == len(reliability.FAULTS) + len(reliability.INPUTS) + len(reliability.LOAD) + 1
    assert all(r.startswith("| ") and r.endswith(" |") and r.count(" | ") == 2 for r in rows)
    assert "(a place, b place) | 2 | all 2: " in table
    assert "| 7 | all 7 answered" in table
    assert "| Rows of 3 batches interrupted and resumed | 40 | rows lost: 0 |" in table
    assert reliability.missing(t) == []
    assert set(reliability.missing(Tally())) >= set(reliability.FAULTS) | set(reliability.INPUTS) | set(reliability.LOAD)
    assert "| Load: well-formed requests" in table and "Bad input: soak" not in table


def test_only_the_section_is_rewritten() -> None:
    text = f"# title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    new = reliability.update_readme(text, _tally())
    assert new.startswith(f"# title\n\nbefore\n{BEGIN}\n| What the tests did |")
    assert new.endswith(f" |\n{END}\nafter\n") and "old table" not in new
    assert reliability.update_readme(new, _tally()) == new
