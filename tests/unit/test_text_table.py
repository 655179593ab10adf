"""flash_inductor.text_table: the one table formatter, and nothing else in the tree padding columns."""

import pathlib
import re

import pytest

from flash_inductor.text_table import markdown_table, text_table

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_columns_pad_to_the_widest_cell_and_align_as_asked():
    lines = text_table([("a", 1, 22), ("bbb", 333, 4)], header=("x", "yy", "z"), align="<>", indent="  ",
                       rule="columns")
    assert lines == ["  x     yy   z",
                     "  ---  ---  --",
                     "  a      1  22",
                     "  bbb  333   4"]


def test_a_line_rule_spans_the_header_and_trailing_blanks_go():
    assert text_table([("a", "1"), ("bb", "22")], header=("k", "v"), align=">", gap=" ", rule="line") == [
        " k  v", "-----", " a  1", "bb 22"]
    assert text_table([("long cell", "x"), ("y", "")]) == ["long cell  x", "y"]


def test_short_rows_and_unknown_rules():
    assert text_table([("a", "b", "c"), ("d",)]) == ["a  b  c", "d"]
    assert text_table([]) == []
    with pytest.raises(ValueError, match="rule"):
        text_table([("a",)], header=("h",), rule="dots")


def test_markdown():
    assert markdown_table(("a", "b"), [(1, 2)]) == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_no_other_module_pads_columns_by_hand():
    """One helper: a module that pads cells with ljust/rjust or writes a markdown rule (`|---`)
    itself is a second copy of it."""
    hand_made = re.compile(r"\.[lr]just\(|[\"']\|---")
    offenders = [str(path.relative_to(ROOT)) for tree in ("flash_inductor", "benchmarks", "tools")
                 for path in sorted((ROOT / tree).rglob("*.py"))
                 if path.name != "text_table.py" and hand_made.search(path.read_text())]
    assert not offenders, f"padding columns by hand instead of flash_inductor.text_table: {offenders}"
