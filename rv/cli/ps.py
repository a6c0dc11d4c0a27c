"""`rv ps [-a] [--json]` (alias `ls`): one line per run, with its segment and the current job's state."""

from __future__ import annotations

from collections.abc import Sequence

import click

from rv.cli.common import note, print_json, run_store, session, warn


def duration(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}-" if d else "") + f"{h:d}:{m:02d}:{s:02d}"


def render_table(views: Sequence) -> list[str]:  # Sequence[RunView]; pure: rows in, lines out
    lines = [
        f"{'NAME':<22} {'SEG':>5} {'STATE':<11} {'EXIT':>4} {'JOB':<9} {'GPUS':<10} {'NODES':>5} "
        f"{'ELAPSED':>10}  SOURCE"
    ]
    for v in views:
        gpus = f"{v.gpus}x{v.gpu_type}" if v.gpus and v.gpu_type else str(v.gpus or "-")
        seg = f"{v.segment}/{v.max_segments}" if v.run_id else "-"
        code = "-" if v.exit_code is None else str(v.exit_code)
        why = f"  ({v.reason})" if v.reason and v.state not in ("RUNNING", "COMPLETED") else ""
        lines.append(
            f"{v.name[:22]:<22} {seg:>5} {v.state[:11]:<11} {code:>4} {(v.job_id or '-'):<9} {gpus:<10} "
            f"{v.nodes:>5} {duration(v.elapsed_seconds):>10}  {v.source}{why}"
        )
    return lines


@click.command()
@click.option("-a", "--all", "all_", is_flag=True, help="Include runs that ended in the last 7 days.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ps(ctx: click.Context, all_: bool, as_json: bool) -> None:
    """List your runs (one line each: segment, state, exit code, why it ended) and other jobs."""
    from rv.job import query
    from rv.job.records import run_views

    store = run_store()
    with session(ctx) as s:
        # One round trip whatever the queue holds: runs, squeue (sacct with -a) and the secrets sweep.
        snap = query.listing(s.transport, s.layout.root, finished=all_, sweep=s.sweep_along())
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
    views = run_views(snap.runs, snap.queued, snap.accounted, now=snap.now, live_only=not all_)
    if as_json:
        print_json([v.to_json() for v in views])
        return
    for line in render_table(views):
        click.echo(line)
