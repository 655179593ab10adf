"""Plain-text and markdown tables: the one formatter behind every report the package and the
benchmarks print (the rewrite report, monitor() and shadow summaries, the stability suite's table,
the tuner's summary, the benchmarks' tables).

It imports nothing of the package, so any module can use it, and the benchmarks and tools (which
sit above the package) import it from here.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["markdown_table", "text_table"]


def text_table(rows: Iterable[Sequence[object]], *, header: Sequence[object] | None = None, align: str = "<",
               gap: str = "  ", indent: str = "", rule: str | None = None) -> list[str]:
    """The rows (and the header above them) as lines of padded columns, trailing blanks stripped.

    ``align`` holds one ``<`` (left) or ``>`` (right) per column; its last character holds for the
    columns past it, so ``"<>"`` is the first column left and the rest right. ``rule`` draws a line
    under the header: ``"columns"`` a run of dashes under each column, ``"line"`` one run as wide as
    the header line. Cells are ``str()``-ed; a row shorter than the widest leaves its last cells empty.
    """
    table = [[str(c) for c in row] for row in ([header] if header is not None else []) + list(rows)]
    if not table:
        return []
    columns = max(len(row) for row in table)
    widths = [max(len(row[i]) for row in table if i < len(row)) for i in range(columns)]
    sides = [align[min(i, len(align) - 1)] for i in range(columns)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if side == ">" else c.ljust(w) for c, w, side in zip(cells, widths, sides)]
        return (indent + gap.join(padded)).rstrip()

    lines = [line(row) for row in table]
    if header is not None and rule == "columns":
        lines.insert(1, indent + gap.join("-" * w for w in widths))
    elif header is not None and rule == "line":
        lines.insert(1, indent + "-" * (len(lines[0]) - len(indent)))
    elif rule is not None and rule not in ("columns", "line"):
        raise ValueError(f"rule={rule!r}: expected None, 'columns' or 'line'")
    return lines


def markdown_table(header: Sequence[object], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table: the header row, its ``|---|`` rule, one line per row."""
    lines = ["| " + " | ".join(str(c) for c in header) + " |", "|---" * len(header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines
