"""What a sweep's points and a run's metrics are, as data: from the agent's replies to rows.

Pure and shared: ``rv sweep results``, ``rv metrics`` and ``rv ps`` render these rows for a terminal
(rv.cli.sweepview), the local page (rv.ui) sends them to the browser, and ``rv sweep retry`` picks
its points from them. Input: the ``metrics`` agent reply (:mod:`rv.agent.metrics`; per run: each
metric's last, lowest and highest value with their steps, and thinned series) and the runs' states
as ``rv ps`` has them (:class:`rv.job.records.RunView`). Nothing here touches the network, click or rich.

Which value is best is the user's word, since a program's metrics do not say: ``--sort NAME:min`` or
``--sort NAME:max``; a bare ``--sort NAME`` guesses from the name (:func:`guess_direction`: ``loss``,
``error``, ``perplexity``... lower; ``acc``, ``reward``, ``score``... higher) and refuses a name it
cannot place. Points are compared by the metric's last value, the one the table shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rv.errors import UsageError

if TYPE_CHECKING:
    from rv.job.query import RunsListing
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

# Points per series the agent sends (rv.agent.metrics.DEFAULT_POINTS): enough for a trend line.
DEFAULT_SERIES_POINTS = 100


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

    def notes(self) -> list[str]:
        """What the reader should know about the file (on stderr)."""
        out = []
        if self.error:
            out.append(f"{self.run_id}: {self.error}")
        if self.bad_lines:
            out.append(
                f"{self.run_id}: {self.bad_lines} line(s) of {self.path} are not JSON objects and were "
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


def points_and_views(snap: RunsListing, name: str) -> tuple[list[PointRun], dict[str, RunView]]:
    """The points of sweep ``name`` in one ``runs`` answer (the newest run of each) and each run's
    row as ``rv ps`` has it; NotFound when the answer holds none."""
    from rv.errors import NotFound
    from rv.job.records import run_views

    points = point_runs(snap.runs, name)
    if not points:
        raise NotFound(f"no sweep named {name!r} on this cluster", hint="rv ps lists runs and sweeps")
    views = {v.run_id: v for v in run_views(snap.runs, snap.queued, now=snap.now) if v.run_id}
    return points, views


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


def param_names(rows: Sequence[PointRow]) -> list[str]:
    names: list[str] = []
    for r in rows:
        names.extend(n for n in r.params if n not in names)
    return names


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


# How `rv ps` sums up a sweep on one line (points running, pending, finished, failed): the states
# rv ps shows, by bucket; anything else (REQUEUED, UNKNOWN, STOPPED...) is "other".
_BUCKETS = (
    ("running", frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "RESIZING", "SIGNALING"})),
    ("pending", frozenset({"PENDING", "SUSPENDED"})),
    ("finished", frozenset({"COMPLETED"})),
    ("failed", RETRY_STATES),
)


def sweep_counts(states: Iterable[str]) -> dict[str, int]:
    """``{"running", "pending", "finished", "failed", "other"}`` counts of the points' states."""
    out = dict.fromkeys([*(name for name, _ in _BUCKETS), "other"], 0)
    for state in states:
        bucket = next((name for name, members in _BUCKETS if state in members), "other")
        out[bucket] += 1
    return out


def sweep_summary(states: Iterable[str]) -> str:
    """``3 running, 2 pending, 5 finished, 1 failed`` (buckets with none left out)."""
    counts = sweep_counts(states)
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n) or "no points"


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
    order: list[RunView | str] = []
    for v in views:
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
