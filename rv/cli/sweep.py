"""`rv sweep results SWEEP [--sort METRIC[:min|max]] [--json|--csv]`, `rv sweep retry SWEEP` and
`rv metrics RUN [-f]`.

Each is one call to the cluster: the agent's ``runs`` mode answers ``sweeps`` (the runs whose run.json
names that sweep) with squeue and, for the results table, every point's metrics
(:func:`rv.agent.metrics.read_runs`); a retry then sends its points in one ``sweep-submit``.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

import click

from rv.cli.common import note, print_json, session, warn
from rv.cli.plot import plot_curve
from rv.cli.sweepview import (
    metrics_notes,
    metrics_table,
    render_text,
    results_csv,
    results_footer,
    results_table,
)
from rv.job.results import DEFAULT_SERIES_POINTS, PointRow, RunMetrics, SortKey, result_rows, results_json


@click.group()
def sweep() -> None:
    """Sweeps: one command run at many points (rv run --sweep), each point a run of its own."""


def emit_results(rows: list[PointRow], sort: SortKey | None, fmt: str, out: IO[str], *, width: int) -> None:
    """The table on ``out`` (stdout: data) as ``fmt`` (json, csv or table); the footer on stderr."""
    if fmt == "json":
        out.write(json.dumps(results_json(rows), indent=2) + "\n")
        return
    if fmt == "csv":
        out.write(results_csv(rows, sort))
        return
    if not rows:
        note("no points")
        return
    if out.isatty():
        from rich.console import Console

        Console(file=out, highlight=False).print(results_table(rows, sort))
    else:
        out.write(render_text(results_table(rows, sort), width=width))
    for line in results_footer(rows, sort):
        note(line)


@sweep.command("results")
@click.argument("name", metavar="SWEEP")
@click.option(
    "--sort",
    "sort_",
    metavar="METRIC[:min|:max]",
    help="Best first by METRIC's last value; :min or :max says which way is better (default: from "
    "the name, e.g. loss is lower, reward higher).",
)
@click.option("--json", "as_json", is_flag=True, help='{"points": [{"index", "params", "state", ...}]}.')
@click.option("--csv", "as_csv", is_flag=True, help="One row per point, every parameter and metric.")
@click.pass_context
def results(ctx: click.Context, name: str, sort_: str | None, as_json: bool, as_csv: bool) -> None:
    """One row per point of SWEEP: its values, state, segments, wall time and the last value of each
    metric its program wrote to $RV_METRICS; the best point marked, a trend of the sort metric."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv are two formats: pick one")
    sort = SortKey.parse(sort_) if sort_ else None  # a bad --sort fails here, before connecting
    with session(ctx) as s:
        rows = _fetch_results(s, name, sort)
    fmt = "json" if as_json else "csv" if as_csv else "table"
    emit_results(rows, sort, fmt, sys.stdout, width=200)


def _fetch_results(s: Any, name: str, sort: SortKey | None) -> list[PointRow]:
    """One round trip: the sweep's runs, squeue and each point's metrics."""
    from rv.job import query
    from rv.job.results import parse_metrics_reply

    metrics = {"series": [sort.metric] if sort else False, "points": DEFAULT_SERIES_POINTS}
    snap = query.fetch(s.transport, s.layout.root, sweeps=[name], metrics=metrics)
    points, views = _points_and_views(snap, name)
    found = parse_metrics_reply(snap.metrics)
    for m in found.values():
        view = views.get(m.run_id)
        for line in m.notes(view.name if view is not None else None):  # the point's name, grid/3
            warn(line)
    return result_rows(points, views, found, sort)


def _points_and_views(snap: Any, name: str) -> tuple[list[Any], dict[str, Any]]:
    """The sweep's points (the newest run of each) and each run's row as rv ps has it."""
    from rv.job.results import points_and_views

    points, views = points_and_views(snap, name)
    if snap.squeue_error:
        warn(f"squeue failed, so which points are queued or running is unknown: {snap.squeue_error}")
    return points, views


@sweep.command("retry")
@click.argument("name", metavar="SWEEP")
@click.option(
    "--parallel",
    type=click.IntRange(min=1),
    metavar="K",
    help="At most K of the points running at once (default: the sweep's own --parallel).",
)
@click.option("--dry-run", is_flag=True, help="List the points a retry would run; send nothing.")
@click.pass_context
def retry(ctx: click.Context, name: str, parallel: int | None, dry_run: bool) -> None:
    """Run again the points of SWEEP that failed or were cancelled (one job array), each as a new run of
    its name (so from its checkpoint, if it saved one), with the same snapshot, environment and command."""
    from rv.cli.common import run_store
    from rv.job.retry import arrays_of, plan_retry, send_retry
    from rv.secrets import job_secrets

    with session(ctx) as s:
        # One round trip for what to retry and how: the sweep's runs, squeue, MaxArraySize, limits.
        plan = plan_retry(s.transport, s.layout.root, name, parallel=parallel, account=s.profile.account)
        if plan.squeue_error:
            warn(f"squeue failed, so which points are queued or running is unknown: {plan.squeue_error}")
        if not plan.indexes:
            note(f"nothing to retry: no point of sweep {name} failed or was cancelled")
            return
        listing = plan.listing()
        if dry_run:
            for part in plan.parts:
                click.echo(f"--array={part.spec}: {part.describe()}")
            count = len(plan.indexes)
            note(f"dry run: would retry {count} point(s) of sweep {name}: {listing}; nothing was sent")
            return
        secrets = job_secrets(s.profile.name, notice=warn)
        if secrets and not plan.first.meta.get("has_secrets"):
            warn(f"sweep {name} was sent without secrets: its points run again as they were, without them")
        sent = send_retry(
            s.transport, s.layout, plan, secrets=secrets or None, profile=s.profile.name, store=run_store()
        )
    if not sys.stdout.isatty():  # data for a script; on a terminal the line below has them
        for array in arrays_of(sent):
            click.echo(array)
    note(
        f"retrying {len(plan.indexes)} point(s) of sweep {name}: {listing}, as job array(s) "
        f"{', '.join(arrays_of(sent))}\n  rv ps {name}    rv sweep results {name}"
    )


def emit_metrics(run: RunMetrics, plot: str | None, out: IO[str], *, width: int) -> None:
    """`rv metrics`: the table, then a plot of one metric (``plot``, else loss-like, else the first).
    What was odd in the file (:func:`metrics_notes`) is the caller's to say, on stderr."""
    if not run.metrics:
        return
    text = render_text(metrics_table(run), width=width)
    out.write(text)
    chosen = plot or next((n for n in sorted(run.metrics) if "loss" in n), min(run.metrics))
    if chosen not in run.metrics:
        raise click.UsageError(f"--plot {chosen}: no such metric; there are {', '.join(sorted(run.metrics))}")
    lines = plot_curve(run.metrics[chosen].series, width=min(60, max(10, width - 12)))
    if lines:
        out.write(f"\n{chosen} by {run.x or 'step'}:\n" + "\n".join(lines) + "\n")


@click.command("metrics")
@click.argument("run", required=False)
@click.option(
    "--plot", "plot", metavar="[METRIC]", is_flag=False, flag_value="",
    help="The metric to plot (default, and a bare --plot: a loss, else the first).",
)  # fmt: skip
@click.option("-f", "--follow", is_flag=True, help="Refresh while the run goes on; stop when it ends.")
@click.option(
    "--interval", type=click.FloatRange(min=0.5), default=5.0, show_default=True, metavar="SECONDS",
    help="With -f: how often to ask the cluster.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="The summary as the cluster sent it.")
@click.pass_context
def metrics(
    ctx: click.Context, run: str | None, plot: str | None, follow: bool, interval: float, as_json: bool
) -> None:
    """Each metric RUN's program wrote to $RV_METRICS: its last and best value and its trend over
    every segment, and a plot of one of them. RUN: a run name (SWEEP/INDEX for a sweep's point), a
    run id, a job id, or nothing (the latest run)."""
    import time

    from rv.cli.common import run_store
    from rv.errors import NotFound
    from rv.job import query
    from rv.job.results import parse_metrics_reply

    if follow and as_json:
        raise click.UsageError("-f redraws a table; --json prints one summary: pick one")
    store = run_store()
    asked = {"series": True, "points": DEFAULT_SERIES_POINTS}
    with session(ctx) as s:
        # One round trip each time: the run's records (has it ended?) and its metrics.
        local = store.resolve(run, s.profile.name)
        root = local.remote_root if local is not None else s.layout.root
        if local is not None:
            snap = query.fetch(s.transport, root, ids=[local.run_id], metrics=asked)
        elif run is not None:
            where = query.selectors(run)
            snap = query.fetch(
                s.transport, root, ids=where["ids"], job_ids=where["job_ids"], any_names=where["any_names"],
                metrics=asked,
            )  # fmt: skip
        else:
            raise NotFound("no runs submitted with this profile yet", hint="rv run -- python train.py")
        runs = [r for r in snap.runs if local is None or r.run_id == local.run_id]
        if not runs:
            raise (
                query.missing(s.transport, root, run, "rv metrics")
                if local is None
                else query.not_on_cluster(run)
            )
        target = runs[-1]
        tty = sys.stdout.isatty()
        shown = None
        try:
            while True:
                found = parse_metrics_reply(snap.metrics)
                if target.run_id not in found:
                    raise NotFound(f"the cluster sent no metrics for run {target.name}")
                if as_json:
                    print_json({"runs": [row for row in snap.metrics if row.get("run_id") == target.run_id]})
                    return
                summary = found[target.run_id]
                text = _metrics_text(summary, plot, width=120)
                if text != shown:
                    if follow and tty:
                        sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
                    for line in metrics_notes(summary, target.name):
                        note(line)
                    sys.stdout.write(text)
                    sys.stdout.flush()
                    shown = text
                ended = next((r for r in snap.runs if r.run_id == target.run_id), target).ended
                if not follow or ended is not None:
                    if follow:
                        note(f"run {target.name} ended: {(ended or {}).get('reason', '?')}")
                    return
                time.sleep(interval)
                snap = query.fetch(s.transport, root, ids=[target.run_id], metrics=asked)
        except KeyboardInterrupt:
            note(f"\nstopped watching; run {target.name} is not affected")
            ctx.exit(130)


def _metrics_text(run: RunMetrics, plot: str | None, *, width: int) -> str:
    import io

    buf = io.StringIO()
    emit_metrics(run, plot, buf, width=width)
    return buf.getvalue()
