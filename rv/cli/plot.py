"""`rv metrics --plot`: one metric's curve in the terminal, in braille dots. Pure: series in, lines out.

Each character cell holds 2×4 dots (Unicode braille, U+2800-U+28FF), so a 60×8 plot has 120×32 dots:
each value is a dot and consecutive values are joined by a line, which reads as a curve where a column
of block characters reads as bars. Labels as a terminal chart has them: the highest value on the top
row, the lowest on the bottom one, the first and last step under the axis.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from rv.cli.sweepview import fmt_value

BRAILLE = 0x2800
# The bit of each dot of a cell, by (row, column) within it: the braille pattern's own numbering.
_DOT = ((0x01, 0x08), (0x02, 0x10), (0x04, 0x20), (0x40, 0x80))


def plot_curve(series: Sequence[tuple[int, float]], *, width: int = 60, height: int = 8) -> list[str]:
    """``series`` ([x, value], in order) as ``height`` rows of ``width`` cells, then the axis and the
    first and last x; [] when there is nothing finite to draw."""
    points = [(x, v) for x, v in series if math.isfinite(v)]
    if not points or width < 1 or height < 1:
        return []
    xs, values = [x for x, _ in points], [v for _, v in points]
    x0, x1, low, high = min(xs), max(xs), min(values), max(values)
    cols, rows = width * 2, height * 4

    def dot_of(x: int, v: float) -> tuple[int, int]:
        col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (cols - 1))
        row = rows // 2 if high == low else round((high - v) / (high - low) * (rows - 1))
        return col, row

    cells = [[0] * width for _ in range(height)]
    previous = None
    for x, v in points:
        here = dot_of(x, v)
        for col, row in _line(previous or here, here):
            cells[row // 4][col // 2] |= _DOT[row % 4][col % 2]
        previous = here
    top, bottom = fmt_value(high), fmt_value(low)
    pad = max(len(top), len(bottom))
    lines = []
    for i, row_cells in enumerate(cells):
        text = top if i == 0 else bottom if i == height - 1 else ""
        drawn = "".join(chr(BRAILLE + bits) if bits else " " for bits in row_cells)
        lines.append(f"{text:>{pad}} ┤{drawn}")
    first, last = str(x0), str(x1)
    lines.append(f"{'':>{pad}} └{'─' * width}")
    lines.append(f"{'':>{pad}}  {first}{' ' * max(1, width - len(first) - len(last))}{last}")
    return lines


def _line(a: tuple[int, int], b: tuple[int, int]) -> Iterator[tuple[int, int]]:
    """The dots from ``a`` to ``b`` (Bresenham's line), both ends included."""
    (c0, r0), (c1, r1) = a, b
    dc, dr = abs(c1 - c0), -abs(r1 - r0)
    sc, sr = (1 if c1 >= c0 else -1), (1 if r1 >= r0 else -1)
    err = dc + dr
    while True:
        yield c0, r0
        if (c0, r0) == (c1, r1):
            return
        twice = 2 * err
        if twice >= dr:
            err += dr
            c0 += sc
        if twice <= dc:
            err += dc
            r0 += sr
