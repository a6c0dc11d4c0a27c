"""What ``rv sweep results``, ``rv metrics`` and ``rv ps SWEEP`` show on a terminal: pure, rows to text.

The rows come from :mod:`rv.job.results` (the agent's replies as data, shared with the local page);
here they become ``--csv`` text and rich renderables (a table with a trend line per point; a small
plot of one metric). Nothing here touches the network; rich is imported only by the functions that
build renderables.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rv.job.results import (
    Direction,
    PointRow,
    PointRun,
    RunMetrics,
    SortKey,
    guess_direction,
    metric_names,
    param_names,
)
from rv.timespec import format_elapsed

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from rv.job.records import RunView

SPARK = "▁▂▃▄▅▆▇█"
BEST_MARK = "★"
# A terminal table shows the sort metric and at most this many others (--json and --csv show all).
TABLE_METRICS = 6


def results_csv(rows: Sequence[PointRow], sort: SortKey | None = None) -> str:
    """index, each parameter, state, segments, wall_seconds, each metric's last value (empty: none)."""
    params, metrics = param_names(rows), metric_names(rows, sort)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["index", *params, "state", "segments", "wall_seconds", *metrics])
    for r in rows:
        writer.writerow(
            [
                r.index,
                *(r.params.get(n, "") for n in params),
                r.state,
                r.segments,
                "" if r.wall_seconds is None else r.wall_seconds,
                *("" if n not in r.metrics else repr_number(r.metrics[n]) for n in metrics),
            ]
        )
    return buf.getvalue()


def repr_number(value: float) -> str:
    """A value as the program wrote it, near enough: integers as integers, floats in full."""
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return str(int(value))
    return repr(value)


def fmt_value(value: float | None) -> str:
    """Four significant digits for tables."""
    if value is None:
        return "-"
    if isinstance(value, int) or (value.is_integer() and abs(value) < 1e6):
        return str(int(value))
    return f"{value:.4g}"


def sparkline(values: Sequence[float], width: int = 16) -> str:
    """``values`` as at most ``width`` block characters, lowest ▁ to highest █ (each a bucket's mean)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite or width < 1:
        return ""
    buckets = _buckets(finite, width)
    low, high = min(buckets), max(buckets)
    if high == low:
        return SPARK[len(SPARK) // 2] * len(buckets)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - low) / (high - low) * top)] for v in buckets)


def _buckets(values: Sequence[float], width: int) -> list[float]:
    """``values`` in at most ``width`` consecutive groups, each its mean."""
    n = len(values)
    if n <= width:
        return list(values)
    out = []
    for i in range(width):
        part = values[i * n // width : (i + 1) * n // width]
        out.append(sum(part) / len(part))
    return out


def results_table(
    rows: Sequence[PointRow], sort: SortKey | None = None, *, max_metrics: int = TABLE_METRICS
) -> Table:
    """The terminal table: point, values, state, segments, wall time, last metrics, trend, best."""
    from rich.table import Table

    params = param_names(rows)
    names = metric_names(rows, sort)
    shown = names[: max_metrics + (1 if sort is not None and names[:1] == [sort.metric] else 0)]
    table = Table(box=None, pad_edge=False, header_style="bold")
    table.add_column("", no_wrap=True)  # the best point's mark
    table.add_column("POINT", justify="right", no_wrap=True)
    for name in params:
        table.add_column(name, no_wrap=True)
    for title in ("STATE", "SEG"):
        table.add_column(title, no_wrap=True, justify="right" if title == "SEG" else "left")
    table.add_column("WALL", justify="right", no_wrap=True)
    for name in shown:
        table.add_column(name, justify="right", no_wrap=True)
    if sort is not None:
        table.add_column(f"{sort.metric} TREND", no_wrap=True)
    for r in rows:
        cells = [
            BEST_MARK if r.best else "",
            str(r.index),
            *(r.params.get(n, "") for n in params),
            r.state,
            str(r.segments),
            format_elapsed(r.wall_seconds),
            *(fmt_value(r.metrics.get(n)) for n in shown),
        ]
        if sort is not None:
            cells.append(sparkline(r.trend))
        table.add_row(*cells, style="bold" if r.best else None)
    return table


def results_footer(
    rows: Sequence[PointRow], sort: SortKey | None, *, max_metrics: int = TABLE_METRICS
) -> list[str]:
    """Lines for stderr under the table: the counts by state, what best means, hidden metrics."""
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    out = [f"{len(rows)} point(s): " + ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items()))]
    if sort is not None:
        if any(r.best for r in rows):
            out.append(f"{BEST_MARK} {sort.describe()}")
        else:
            out.append(f"no point has written {sort.metric} yet")
    hidden = len(metric_names(rows, sort)) - max_metrics - (1 if sort is not None else 0)
    if hidden > 0:
        out.append(f"{hidden} more metric(s) not shown: --json or --csv has every one")
    return out


# States `rv sweep retry` runs again: the point ended without finishing and nothing of it is live.
# --- rv metrics RUN -----------------------------------------------------------------------------


def metrics_table(run: RunMetrics, directions: Mapping[str, Direction] | None = None) -> Table:
    """Each metric: its last value and step, its best (by ``directions``, else by its name; ``-``
    where neither says) and step, how many values, and its trend over every segment."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    x = "STEP" if run.x != "line" else "LINE"
    for title, justify in (("METRIC", "left"), ("LAST", "right"), (f"AT {x}", "right"), ("BEST", "right"),
                           (f"AT {x} ", "right"), ("N", "right"), ("TREND", "left")):  # fmt: skip
        table.add_column(title, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for name, m in sorted(run.metrics.items()):
        way = (directions or {}).get(name) or guess_direction(name)
        best, best_x = m.best(way) if way else (None, None)
        arrow = {"min": " ↓", "max": " ↑"}.get(way or "", "")
        table.add_row(
            name, fmt_value(m.last), _x(m.last_x), fmt_value(best) + (arrow if best is not None else ""),
            _x(best_x), str(m.count), sparkline([v for _, v in m.series], 24),
        )  # fmt: skip
    return table


def _x(value: int | None) -> str:
    return "-" if value is None else str(value)


def metrics_notes(run: RunMetrics) -> list[str]:
    """stderr lines under ``rv metrics``: where the file is and what was odd in it."""
    if not run.exists:
        return [f"{run.run_id}: no metrics yet: {run.path} does not exist (programs write to $RV_METRICS)"]
    out = run.notes()
    if run.rewinds:
        out.append(
            f"{run.run_id}: {run.rewinds} line(s) left out: a later segment went back to an earlier step "
            "and wrote those steps again"
        )
    if run.joined_lines:
        out.append(
            f"{run.run_id}: {run.joined_lines} line(s) began with a half line a killed segment left; "
            "their complete part was read"
        )
    if run.partial:
        out.append(f"{run.run_id}: the last line is being written; it is left out")
    return out


def render_text(renderable: RenderableType, *, width: int = 120) -> str:
    """A rich renderable as plain text (tests, and output that is not a terminal)."""
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False).print(renderable)
    return buf.getvalue()


def point_lines(points: Sequence[PointRun], views: Mapping[str, RunView]) -> list[str]:
    """`rv ps SWEEP`: one line per point, its values beside rv ps's columns."""
    params = param_names([PointRow(p.index, p.params, p.run_id, "", 0, None, {}) for p in points])
    rows = [["POINT", *params, "SEG", "STATE", "EXIT", "JOB", "ELAPSED", ""]]
    for p in points:
        v = views.get(p.run_id or "")
        if v is None:
            rows.append(
                [str(p.index), *(p.params.get(n, "") for n in params), "-", "UNKNOWN", "-", "-", "-", ""]
            )
            continue
        why = v.reason if v.reason and v.state not in ("RUNNING", "COMPLETED") else ""
        rows.append(
            [str(p.index), *(p.params.get(n, "") for n in params), v.segments_text(), v.state,
             "-" if v.exit_code is None else str(v.exit_code), v.job_id or "-",
             format_elapsed(v.elapsed_seconds), f"({why})" if why else ""]
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[-1]]).rstrip() for r in rows]
