"""`rv sweep results SWEEP [--sort METRIC[:min|max]] [--json|--csv]` and `rv metrics RUN`.

Not registered in rv.cli.main yet (phase 2 of the sweeps issue wires it): the options, the checks made
before anything is sent, and the output are final; the one call to the cluster assumes the agent's
``runs`` mode answers ``sweeps`` (the runs whose run.json names that sweep) and carries ``metrics``
(:func:`rv.agent.metrics.read_runs` for those runs), so the whole table is one round trip.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

import click

from rv.cli.common import note, print_json, session, warn
from rv.sweepview import (
    DEFAULT_SERIES_POINTS,
    PointRow,
    RunMetrics,
    SortKey,
    metrics_notes,
    metrics_table,
    plot_lines,
    render_text,
    result_rows,
    results_csv,
    results_footer,
    results_json,
    results_table,
)


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
    from rv.agent_client import call_agent
    from rv.errors import NotFound
    from rv.job.records import parse_runs, run_views
    from rv.slurm import commands
    from rv.slurm.parse import parse_squeue
    from rv.sweepview import parse_metrics_reply, point_runs

    args = {
        "root": s.layout.root,
        "sweeps": [name],
        "squeue": commands.squeue_user(),
        "metrics": {"series": [sort.metric] if sort else False, "points": DEFAULT_SERIES_POINTS},
    }
    reply = call_agent(s.transport, "runs", args, timeout=120)
    runs = parse_runs(reply.get("runs") or [])
    points = point_runs(runs, name)
    if not points:
        raise NotFound(f"no sweep named {name!r} on this cluster", hint="rv ps lists sweeps")
    squeue = reply.get("squeue") or {}
    if squeue.get("error"):
        warn(f"squeue failed, so which points are queued or running is unknown: {squeue['error']}")
    views = {
        v.run_id: v
        for v in run_views(runs, parse_squeue(squeue.get("text") or ""), now=float(reply.get("now") or 0))
        if v.run_id
    }
    found = parse_metrics_reply((reply.get("metrics") or {}).get("runs") or [])
    for m in found.values():
        for line in m.notes():
            warn(line)
    return result_rows(points, views, found, sort)


def emit_metrics(run: RunMetrics, plot: str | None, out: IO[str], *, width: int) -> None:
    """`rv metrics`: the table, then a plot of one metric (``plot``, else loss-like, else the first)."""
    for line in metrics_notes(run):
        note(line)
    if not run.metrics:
        return
    text = render_text(metrics_table(run), width=width)
    out.write(text)
    chosen = plot or next((n for n in sorted(run.metrics) if "loss" in n), min(run.metrics))
    if chosen not in run.metrics:
        raise click.UsageError(f"--plot {chosen}: no such metric; there are {', '.join(sorted(run.metrics))}")
    lines = plot_lines(run.metrics[chosen].series, width=min(60, max(10, width - 12)))
    if lines:
        out.write(f"\n{chosen} by {run.x or 'step'}:\n" + "\n".join(lines) + "\n")


@click.command("metrics")
@click.argument("run", required=False)
@click.option(
    "--plot", "plot", metavar="METRIC", help="The metric to plot (default: a loss, else the first)."
)
@click.option("--json", "as_json", is_flag=True, help="The summary as the cluster sent it.")
@click.pass_context
def metrics(ctx: click.Context, run: str | None, plot: str | None, as_json: bool) -> None:
    """Each metric RUN's program wrote to $RV_METRICS: its last and best value and its trend over
    every segment, and a plot of one of them."""
    from rv.agent_client import call_agent
    from rv.cli.common import run_store
    from rv.job import query
    from rv.sweepview import parse_metrics_reply

    with session(ctx) as s:
        found = query.resolve(s.transport, run_store(), s.profile.name, s.layout.root, run)
        root = found.record.remote_root if found.record else s.layout.root
        reply = call_agent(
            s.transport,
            "metrics",
            {"root": root, "runs": [found.run.run_id], "points": DEFAULT_SERIES_POINTS},
        )
    if as_json:
        print_json(reply)
        return
    summary = parse_metrics_reply(reply.get("runs") or [])[found.run.run_id]
    emit_metrics(summary, plot, sys.stdout, width=120)
