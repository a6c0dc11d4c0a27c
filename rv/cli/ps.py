"""`rv ps [-a] [--json] [SWEEP]` (alias `ls`): one line per run, with its segment and the current job's
state, and one per sweep (its points counted by state); with SWEEP, one line per point of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import click

from rv.cli.common import note, print_json, run_store, session, warn
from rv.timespec import format_elapsed

if TYPE_CHECKING:
    from rv.job.records import RunView


def render_table(views: Sequence[RunView], sus: Mapping[str, str] | None = None) -> list[str]:  # pure
    """The table's lines; ``sus`` (`rv ps -a`): an SU column, the text for each ended run or sweep by
    name ("-" where there is none)."""
    # Columns as wide as their longest value: a name cut at 22 characters could not be typed back
    # into `rv logs NAME`, and two runs could show the same prefix.
    rows = []
    for v in views:
        gpus = f"{v.gpus}x{v.gpu_type}" if v.gpus and v.gpu_type else str(v.gpus or "-")
        code = "-" if v.exit_code is None else str(v.exit_code)
        # A sweep's line (its points) always says how many points are in which state.
        shown = v.reason and (v.points or v.state not in ("RUNNING", "COMPLETED"))
        why = f"  ({v.why or v.reason})" if shown else ""
        row: tuple[str, ...] = (v.name, v.segments_text(), v.state, code, v.job_id or "-", gpus, str(v.nodes),
               format_elapsed(v.elapsed_seconds))  # fmt: skip
        if sus is not None:
            row += (sus.get(v.name, "-"),)
        rows.append((*row, f"{v.source}{why}"))
    head: tuple[str, ...] = ("NAME", "SEG", "STATE", "EXIT", "JOB", "GPUS", "NODES", "ELAPSED")
    head += ("SU", "SOURCE") if sus is not None else ("SOURCE",)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    right = {1, 3, 6, 7, 8}  # numbers line up on the right (the SU column's too)
    lines = []
    for r in [head, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=False))
        ]
        lines.append(" ".join(cells) + "  " + r[-1])
    return lines


@click.command()
@click.argument("sweep", metavar="[SWEEP]", required=False)
@click.option("-a", "--all", "all_", is_flag=True, help="Include runs that ended in the last 7 days.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ps(ctx: click.Context, sweep: str | None, all_: bool, as_json: bool) -> None:
    """List your runs (one line each: segment, state, exit code, why it ended), sweeps (one line each:
    how many points are in which state) and other jobs; with SWEEP, each point of that sweep."""
    from rv.job import query
    from rv.job.records import run_views
    from rv.job.results import fold_sweeps

    store = run_store()
    with session(ctx) as s:
        # One round trip whatever the queue holds: runs, squeue (sacct with -a) and the secrets sweep.
        snap = query.listing(
            s.transport, s.layout.root, finished=all_, sweep=s.sweep_along(), sweeps=[sweep] if sweep else []
        )
        s.swept(snap.sweep)
        mine = {r.run_id: r for r in store.all(s.profile.name)}
        query.cache_learned_many(
            store, s.profile.name, [(mine[run.run_id], run) for run in snap.runs if run.run_id in mine]
        )
    if snap.squeue_error:
        warn(f"squeue failed, so what is queued or running is unknown: {snap.squeue_error}")
    if all_ and snap.sacct_error:
        # Expected on clusters without accounting: rv's own records still give every run's end.
        note(f"no sacct here ({snap.sacct_error.splitlines()[0]}): finished runs come from rv's records")
    if sweep:
        _points(snap, sweep, as_json)
        return
    views = run_views(snap.runs, snap.queued, snap.accounted, now=snap.now)
    serves = {r.run_id: r.serves for r in mine.values() if r.serves}
    # -a: what each ended run cost (rv stats's SUs: the catalog's rate x GPUs x each segment's hours).
    sus = ended_sus(snap.runs, s.profile.gpu_catalog(), snap.now) if all_ else {}
    if as_json:
        # Data: a sweep's points stay runs of their own (each names its sweep and index).
        rows = [
            dict(
                v.to_json(),
                **_served(serves.get(v.run_id or "")),
                **({"su": sus.get(v.run_id or "")} if all_ else {}),
            )
            for v in views
            if v.live or all_
        ]
        print_json(rows)
        return
    folded = fold_sweeps(views, live_only=not all_)
    for line in render_table(folded, su_column(folded, views, sus) if all_ else None):
        click.echo(line)
    for line in served_lines(views, serves):
        click.echo(line)
    if not folded:
        # A bare header reads as "rv lost my runs": say where the ended ones are.
        note(
            "no runs in the last 7 days: rv run -- python train.py"
            if all_
            else "nothing queued or running: rv ps -a adds what ended in the last 7 days"
        )


def ended_sus(runs: Sequence, catalog: Mapping, now: float) -> dict[str, float | None]:  # type: ignore[type-arg]
    """Each ended GPU run's SUs by run id (None: no rate for it); a CPU run has none to show."""
    from rv.job.stats import run_stats

    ended = [r for r in runs if r.ended is not None and r.meta.get("gpus")]
    return {r.run_id: run_stats(r, {}, catalog, now).su for r in ended}


def su_column(
    folded: Sequence[RunView], views: Sequence[RunView], sus: Mapping[str, float | None]
) -> dict[str, str]:
    """The SU column's text by line name: an ended run's SUs, a sweep's total over its ended points
    ("?" where one has no rate), "-" for what has not ended."""
    out = {}
    for v in folded:
        if v.points:
            got = [
                sus[p.run_id] for p in views if p.sweep == v.name and p.run_id is not None and p.run_id in sus
            ]
            if got:
                out[v.name] = "?" if any(x is None for x in got) else f"{sum(x or 0.0 for x in got):,.1f}"
        elif v.run_id in sus:
            su = sus[v.run_id or ""]
            out[v.name] = "?" if su is None else f"{su:,.1f}"
    return out


def _served(serves: dict | None) -> dict:  # type: ignore[type-arg]
    return {"serves": serves} if serves else {}


def served_lines(views: Sequence, serves: dict) -> list[str]:  # type: ignore[type-arg]
    """Below the table: what each live `rv code` / `rv jupyter` session serves (pure)."""
    lines = []
    for v in views:
        what = serves.get(v.run_id or "") if v.live and v.state == "RUNNING" else None
        if not what:
            continue
        if what.get("editor_host"):
            lines.append(f"{v.name}: editor  ssh {what['editor_host']}  (rv code --name {v.name})")
        if what.get("notebook_url"):
            lines.append(f"{v.name}: notebook {what['notebook_url']}  (rv jupyter --name {v.name})")
    return ["", *lines] if lines else []


def _points(snap, sweep: str, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    """`rv ps SWEEP`: one line per point (the newest run of each)."""
    from rv.cli.sweepview import point_lines
    from rv.errors import NotFound
    from rv.job.records import run_views
    from rv.job.results import point_runs

    points = point_runs(snap.runs, sweep)
    if not points:
        raise NotFound(f"no sweep named {sweep!r} on this cluster", hint="rv ps lists runs and sweeps")
    views = {v.run_id: v for v in run_views(snap.runs, snap.queued, snap.accounted, now=snap.now) if v.run_id}
    if as_json:
        print_json([views[p.run_id].to_json() for p in points if p.run_id in views])
        return
    for line in point_lines(points, views):
        click.echo(line)
