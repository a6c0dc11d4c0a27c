"""What ``rv sweep results`` and ``rv metrics`` show: pure, from the agent's replies to text.

Input: the ``metrics`` agent reply (:mod:`rv.agent.metrics`; per run: each metric's last, lowest and
highest value with their steps, and thinned series) and the runs' states as ``rv ps`` has them
(:class:`rv.job.records.RunView`). Output: rows, the ``--json`` object, ``--csv`` text, and rich
renderables for a terminal (a table with a trend line per point; a small plot of one metric). Nothing
here touches the network; rich is imported only by the functions that build renderables.

Which value is best is the user's word, since a program's metrics do not say: ``--sort NAME:min`` or
``--sort NAME:max``; a bare ``--sort NAME`` guesses from the name (:func:`guess_direction`: ``loss``,
``error``, ``perplexity``... lower; ``acc``, ``reward``, ``score``... higher) and refuses a name it
cannot place. Points are compared by the metric's last value, the one the table shows.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rv.errors import UsageError
from rv.timespec import format_elapsed

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from rv.job.records import ClusterRun, RunView

Direction = Literal["min", "max"]

# Words in a metric's name that say which way is better (matched as whole words of the name, split
# on anything not a letter: train/loss, val_acc, eval-perplexity).
_LOWER = frozenset(
    {"loss", "error", "err", "perplexity", "ppl", "nll", "mse", "mae", "rmse", "wer", "cer", "kl", "regret",
     "latency", "time", "seconds", "cost", "bpd", "bpb"}
)  # fmt: skip
_HIGHER = frozenset(
    {"acc", "accuracy", "reward", "score", "f1", "bleu", "rouge", "auc", "auroc", "precision", "recall",
     "return", "success", "win", "map", "iou", "dice", "throughput"}
)  # fmt: skip

SPARK = "▁▂▃▄▅▆▇█"
BEST_MARK = "★"
# Points per series the agent sends (rv.agent.metrics.DEFAULT_POINTS): enough for a trend line.
DEFAULT_SERIES_POINTS = 100
# A terminal table shows the sort metric and at most this many others (--json and --csv show all).
TABLE_METRICS = 6


def guess_direction(name: str) -> Direction | None:
    """``min`` for names that read lower-is-better, ``max`` for higher-is-better, else None."""
    words = {w for w in re.split(r"[^a-z0-9]+", name.lower()) if w}
    words |= {w.rstrip("s") for w in words}
    lower, higher = bool(words & _LOWER), bool(words & _HIGHER)
    if lower == higher:
        return None
    return "min" if lower else "max"


@dataclass(frozen=True)
class SortKey:
    metric: str
    direction: Direction
    guessed: bool  # the direction came from the name, not from the user

    @classmethod
    def parse(cls, text: str) -> SortKey:
        """``NAME:min``, ``NAME:max`` or ``NAME`` (direction from the name)."""
        name, colon, way = text.strip().rpartition(":")
        if not colon:
            name, way = text.strip(), ""
        if not name:
            raise UsageError(
                f"--sort {text!r}: no metric named", hint="e.g. --sort loss:min or --sort reward:max"
            )
        if way in ("min", "max"):
            return cls(name, way, guessed=False)  # type: ignore[arg-type]  # narrowed by the test above
        if way:
            raise UsageError(
                f"--sort {text!r}: {way!r} is not a direction", hint=f"--sort {name}:min or --sort {name}:max"
            )
        guessed = guess_direction(name)
        if guessed is None:
            raise UsageError(
                f"--sort {name}: rv cannot tell whether a higher or a lower {name} is better",
                hint=f"say which: --sort {name}:min or --sort {name}:max",
            )
        return cls(name, guessed, guessed=True)

    def better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "min" else a > b

    def describe(self) -> str:
        word = "lowest" if self.direction == "min" else "highest"
        return f"best: the {word} last {self.metric}" + (
            " (from its name; say :min or :max)" if self.guessed else ""
        )


# --- the agent's reply ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSummary:
    last: float
    last_x: int | None
    min: float
    min_x: int | None
    max: float
    max_x: int | None
    count: int
    series: tuple[tuple[int, float], ...] = ()

    def best(self, direction: Direction) -> tuple[float, int | None]:
        return (self.min, self.min_x) if direction == "min" else (self.max, self.max_x)


@dataclass(frozen=True)
class RunMetrics:
    run_id: str
    path: str | None
    exists: bool
    metrics: Mapping[str, MetricSummary] = field(default_factory=dict)
    x: str | None = None  # "step" or "line"
    partial: bool = False  # the last line was being written
    bad_lines: int = 0
    first_bad_line: int | None = None
    rewinds: int = 0
    joined_lines: int = 0  # lines split where a killed segment's half line met the next one's
    error: str | None = None

    def notes(self, label: str | None = None) -> list[str]:
        """What the reader should know about the file (on stderr), each line headed by ``label``
        (the run's name, ``grid/3``; its id when none is given)."""
        who = label or self.run_id
        out = []
        if self.error:
            out.append(f"{who}: {self.error}")
        if self.bad_lines:
            out.append(
                f"{who}: {self.bad_lines} line(s) of {self.path} are not JSON objects and were "
                f"skipped (the first: line {self.first_bad_line})"
            )
        return out


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_metrics_reply(rows: Iterable[Mapping[str, Any]]) -> dict[str, RunMetrics]:
    """The ``metrics`` mode's ``runs`` (or the same rows carried by a ``runs`` call), by run id."""
    out = {}
    for row in rows:
        metrics = {}
        for name, m in (row.get("metrics") or {}).items():
            last, low, high = _num(m.get("last")), _num(m.get("min")), _num(m.get("max"))
            if last is None or low is None or high is None:
                continue
            series = tuple(
                (int(p[0]), float(p[1]))
                for p in m.get("series") or ()
                if _num(p[0]) is not None and _num(p[1]) is not None
            )
            metrics[name] = MetricSummary(
                last=last, last_x=_opt_int(m.get("last_x")), min=low, min_x=_opt_int(m.get("min_x")),
                max=high, max_x=_opt_int(m.get("max_x")), count=int(m.get("count") or 0), series=series,
            )  # fmt: skip
        out[row["run_id"]] = RunMetrics(
            run_id=row["run_id"], path=row.get("path"), exists=bool(row.get("exists")), metrics=metrics,
            x=row.get("x"), partial=bool(row.get("partial")), bad_lines=int(row.get("bad_lines") or 0),
            first_bad_line=_opt_int(row.get("first_bad_line")), rewinds=int(row.get("rewinds") or 0),
            joined_lines=int(row.get("joined_lines") or 0),
            error=row.get("error"),
        )  # fmt: skip
    return out


# --- the sweep's points ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PointRun:
    """A point of a sweep and the run that is it (None: no run was made for it)."""

    index: int
    params: Mapping[str, str]
    run_id: str | None


def point_runs(runs: Iterable[ClusterRun], sweep: str) -> list[PointRun]:
    """The points of ``sweep`` from the runs' ``run.json`` (``"sweep": {"name", "index", "params"}``,
    written by run-submit for each point), the newest run of each index, by index."""
    newest: dict[int, tuple[float, PointRun]] = {}
    for run in runs:
        info = run.meta.get("sweep")
        if (
            not isinstance(info, Mapping)
            or info.get("name") != sweep
            or not isinstance(info.get("index"), int)
        ):
            continue
        created = float(run.meta.get("created") or 0)
        point = PointRun(info["index"], dict(info.get("params") or {}), run.run_id)
        if info["index"] not in newest or created >= newest[info["index"]][0]:
            newest[info["index"]] = (created, point)
    return [newest[i][1] for i in sorted(newest)]


# --- rv sweep results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PointRow:
    index: int
    params: Mapping[str, str]
    run_id: str | None
    state: str
    segments: int
    wall_seconds: int | None
    metrics: Mapping[str, float]  # each metric's last value
    trend: tuple[float, ...] = ()  # the sort metric's series
    best: bool = False

    def to_json(self) -> dict[str, Any]:
        """The documented shape of one point in ``--json`` (nothing else: scripts rely on it)."""
        return {
            "index": self.index,
            "params": dict(self.params),
            "state": self.state,
            "segments": self.segments,
            "wall_seconds": self.wall_seconds,
            "metrics": dict(self.metrics),
        }


def result_rows(
    points: Sequence[PointRun],
    views: Mapping[str, RunView],
    metrics: Mapping[str, RunMetrics],
    sort: SortKey | None = None,
) -> list[PointRow]:
    """One row per point; with ``sort``, best first (points without the metric last, by index) and
    the best one marked. A point with no run, or one no record of which came back, is ``UNKNOWN``."""
    rows = []
    for p in points:
        view = views.get(p.run_id) if p.run_id else None
        found = metrics.get(p.run_id) if p.run_id else None
        summaries = found.metrics if found else {}
        trend = summaries[sort.metric].series if sort and sort.metric in summaries else ()
        rows.append(
            PointRow(
                index=p.index,
                params=dict(p.params),
                run_id=p.run_id,
                state=view.state if view else "UNKNOWN",
                segments=view.segment if view else 0,
                wall_seconds=view.elapsed_seconds if view else None,
                metrics={name: s.last for name, s in sorted(summaries.items())},
                trend=tuple(v for _, v in trend),
            )
        )
    if sort is None:
        return sorted(rows, key=lambda r: r.index)
    with_value = [r for r in rows if sort.metric in r.metrics]
    without = sorted((r for r in rows if sort.metric not in r.metrics), key=lambda r: r.index)
    sign = 1 if sort.direction == "min" else -1
    with_value.sort(key=lambda r: (sign * r.metrics[sort.metric], r.index))
    if with_value:
        best = with_value[0]
        with_value[0] = PointRow(**{**best.__dict__, "best": True})
    return with_value + without


def results_json(rows: Sequence[PointRow]) -> dict[str, Any]:
    """``{"points": [{"index", "params", "state", "segments", "wall_seconds", "metrics"}, ...]}``."""
    return {"points": [r.to_json() for r in rows]}


def metric_names(rows: Sequence[PointRow], sort: SortKey | None = None) -> list[str]:
    """Every metric any point has: the sort metric first, then by name."""
    names = sorted({n for r in rows for n in r.metrics})
    if sort is not None and sort.metric in names:
        names.remove(sort.metric)
        names.insert(0, sort.metric)
    return names


def _param_names(rows: Sequence[PointRow]) -> list[str]:
    names: list[str] = []
    for r in rows:
        names.extend(n for n in r.params if n not in names)
    return names


def results_csv(rows: Sequence[PointRow], sort: SortKey | None = None) -> str:
    """index, each parameter, state, segments, wall_seconds, each metric's last value (empty: none)."""
    params, metrics = _param_names(rows), metric_names(rows, sort)
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

    params = _param_names(rows)
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
# Not COMPLETED; not STOPPED (the program stopped itself, or used every segment: `--max-segments`);
# never UNKNOWN (no record of an end, and maybe only squeue failed: the point may still be running).
RETRY_STATES = frozenset(
    {"FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "LOST", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
     "DEADLINE"}
)  # fmt: skip


def retry_points(rows: Sequence[PointRow]) -> list[int]:
    """The indexes ``rv sweep retry`` resubmits, in order: points that failed or were cancelled, and
    points no run was ever made for (their submission failed part way)."""
    return sorted(r.index for r in rows if r.run_id is None or r.state in RETRY_STATES)


# How `rv ps` sums up a sweep on one line (points running, pending, finished, failed, cancelled): the
# states rv ps shows, by bucket; anything else (UNKNOWN, STOPPED...) is "other". A cancelled point
# (rv stop SWEEP) is no failed one: `rv ps SWEEP` and `rv sweep results` say CANCELLED too.
_BUCKETS = (
    ("running", frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SIGNALING"})),
    ("pending", frozenset({"PENDING", "SUSPENDED"})),
    ("finished", frozenset({"COMPLETED"})),
    ("failed", RETRY_STATES - {"CANCELLED"}),
    ("cancelled", frozenset({"CANCELLED"})),
)


def sweep_counts(states: Iterable[str]) -> dict[str, int]:
    """``{"running", "pending", "finished", "failed", "cancelled", "other"}`` counts of the points' states."""
    out = dict.fromkeys([*(name for name, _ in _BUCKETS), "other"], 0)
    for state in states:
        bucket = next((name for name, members in _BUCKETS if state in members), "other")
        out[bucket] += 1
    return out


def sweep_summary(states: Iterable[str]) -> str:
    """``3 running, 2 pending, 5 finished, 1 failed`` (buckets with none left out)."""
    counts = sweep_counts(states)
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n) or "no points"


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


def plot_lines(series: Sequence[tuple[int, float]], *, width: int = 60, height: int = 8) -> list[str]:
    """A small plot of one series in unicode blocks: ``height`` rows of ``width`` columns (each
    column the mean of its x range, drawn as a bar in eighths), the highest and lowest value on the
    left, the first and last x below."""
    points = [(x, v) for x, v in series if math.isfinite(v)]
    if not points or width < 1 or height < 1:
        return []
    values = _columns(points, width)
    low, high = min(v for v in values if v is not None), max(v for v in values if v is not None)
    span = (high - low) or 1.0
    labels = [fmt_value(high), fmt_value(low)]
    pad = max(len(s) for s in labels)
    levels = height * 8
    # Each column's bar, in eighths of a row, at least one eighth so the lowest still shows.
    bars = [None if v is None else max(1, round((v - low) / span * levels)) for v in values]
    lines = []
    for row in range(height, 0, -1):
        floor = (row - 1) * 8
        cells = []
        for b in bars:
            if b is None or b <= floor:
                cells.append(" ")
            elif b >= floor + 8:
                cells.append("█")
            else:
                cells.append(SPARK[b - floor - 1])
        label = labels[0] if row == height else (labels[1] if row == 1 else "")
        lines.append(f"{label:>{pad}} ┤{''.join(cells)}")
    first, last = str(points[0][0]), str(points[-1][0])
    gap = max(1, len(values) - len(first) - len(last))
    lines.append(f"{'':>{pad}} └{'─' * len(values)}")
    lines.append(f"{'':>{pad}}  {first}{' ' * gap}{last}")
    return lines


def _columns(points: Sequence[tuple[int, float]], width: int) -> list[float | None]:
    """The series on ``width`` columns by x: each column the mean of the points in its x range; a
    column with none is None. Fewer points than columns: one column per point."""
    if len(points) <= width:
        return [v for _, v in points]
    lo, hi = points[0][0], points[-1][0]
    if hi <= lo:
        return [float(b) for b in _buckets([v for _, v in points], width)]
    sums = [0.0] * width
    counts = [0] * width
    for x, v in points:
        col = min(width - 1, max(0, (x - lo) * width // (hi - lo + 1)))
        sums[col] += v
        counts[col] += 1
    return [s / c if c else None for s, c in zip(sums, counts, strict=True)]


def metrics_notes(run: RunMetrics, label: str | None = None) -> list[str]:
    """stderr lines under ``rv metrics``: where the file is and what was odd in it, each headed by
    ``label`` (the run's name; its id when none is given)."""
    who = label or run.run_id
    if run.error:
        return run.notes(label)
    if not run.exists:
        return [f"{who}: no metrics yet: {run.path} does not exist (programs write to $RV_METRICS)"]
    out = run.notes(label)
    if run.rewinds:
        out.append(
            f"{who}: {run.rewinds} line(s) left out: a later segment went back to an earlier step "
            "and wrote those steps again"
        )
    if run.joined_lines:
        out.append(
            f"{who}: {run.joined_lines} line(s) began with a half line a killed segment left; "
            "their complete part was read"
        )
    if run.partial:
        out.append(f"{who}: the last line is being written; it is left out")
    return out


def render_text(renderable: RenderableType, *, width: int = 120) -> str:
    """A rich renderable as plain text (tests, and output that is not a terminal)."""
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, highlight=False).print(renderable)
    return buf.getvalue()


# --- rv ps: one line per sweep, or one per point of one sweep -------------------------------------------


def _latest_points(views: Iterable[RunView]) -> list[RunView]:
    """The newest run of each point (a retried point has two), by index. ``views``: newest first."""
    latest: dict[int, RunView] = {}
    for v in views:
        if v.sweep_index is not None:
            latest.setdefault(v.sweep_index, v)
    return [latest[i] for i in sorted(latest)]


def _sweep_state(states: Sequence[str]) -> str:
    counts = sweep_counts(states)
    if counts["running"]:
        return "RUNNING"
    if counts["pending"]:
        return "PENDING"
    if counts["finished"] == len(states):
        return "COMPLETED"
    if counts["failed"]:
        return "FAILED"
    if counts["cancelled"]:
        return "CANCELLED"
    return max(set(states), key=states.count) if states else "UNKNOWN"


def _array_of(job_id: str | None) -> str | None:
    return job_id.split("_", 1)[0] if job_id else None


def fold_sweeps(views: Sequence[RunView], *, live_only: bool) -> list[RunView]:
    """`rv ps`'s rows: each sweep's points as one row (where its newest point stood; ``points`` says
    how many, ``reason`` counts them by state), every other row as it is. ``views`` come newest first
    and whole (``run_views(live_only=False)``): with ``live_only``, a row stays when it is live, and a
    sweep when any of its points is (its line counts them all)."""
    from rv.job.records import RunView

    groups: dict[str, list[RunView]] = {}
    arrays: dict[str, list[RunView]] = {}  # jobs of a job array rv has no record of: one line each
    order: list[RunView | str | tuple[str, str]] = []
    for v in views:
        task = _task_of(v) if v.run_id is None else None
        if task is not None:
            # An array task Slurm knows and rv's records do not (after `rv gc`, a sweep's points are
            # sacct's jobs): one line per array, as for a sweep.
            if task[0] not in arrays:
                arrays[task[0]] = []
                order.append(task)
            arrays[task[0]].append(v)
            continue
        if v.sweep is None or v.sweep_index is None:
            if v.live or not live_only:
                order.append(v)
            continue
        if v.sweep not in groups:
            groups[v.sweep] = []
            order.append(v.sweep)
        groups[v.sweep].append(v)
    out = []
    for item in order:
        if isinstance(item, tuple):
            tasks = arrays[item[0]]
            if len(tasks) == 1:
                out.append(tasks[0])
            elif not live_only or any(t.live for t in tasks):
                out.append(_array_line(item[0], tasks))
            continue
        if not isinstance(item, str):
            out.append(item)
            continue
        points = _latest_points(groups[item])
        if live_only and not any(p.live for p in points):
            continue
        states = [p.state for p in points]
        first = points[0]
        elapsed = [p.elapsed_seconds for p in points if p.elapsed_seconds is not None]
        out.append(
            RunView(
                name=item, run_id=None, segment=0, max_segments=0, state=_sweep_state(states),
                job_id=_array_of(first.job_id), live=any(p.live for p in points),
                reason=sweep_summary(states), exit_code=None, gpus=first.gpus, gpu_type=first.gpu_type,
                nodes=first.nodes, elapsed_seconds=max(elapsed) if elapsed else None, source=first.source,
                created=max((p.created or 0) for p in points) or None,
                jobs=tuple(j for p in points for j in p.jobs), sweep=item, points=len(points),
            )
        )  # fmt: skip
    return out


def _task_of(v: RunView) -> tuple[str, str] | None:
    """(array id, task) of a job that is one task of a job array (``123_4``), else None."""
    base, _, task = (v.job_id or "").partition("_")
    return (base, task) if base.isdigit() and task.isdigit() else None


def _array_line(array: str, tasks: Sequence[RunView]) -> RunView:
    """`rv ps`'s one line for a job array's tasks (not rv's runs): counted by state, as a sweep's."""
    import dataclasses

    states = [t.state for t in tasks]
    elapsed = [t.elapsed_seconds for t in tasks if t.elapsed_seconds is not None]
    return dataclasses.replace(
        tasks[0], state=_sweep_state(states), job_id=array, live=any(t.live for t in tasks),
        reason=sweep_summary(states), exit_code=None, elapsed_seconds=max(elapsed) if elapsed else None,
        jobs=tuple(t.job_id or "" for t in tasks), points=len(tasks),
    )  # fmt: skip


def point_lines(points: Sequence[PointRun], views: Mapping[str, RunView]) -> list[str]:
    """`rv ps SWEEP`: one line per point, its values beside rv ps's columns."""
    params = _param_names([PointRow(p.index, p.params, p.run_id, "", 0, None, {}) for p in points])
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
