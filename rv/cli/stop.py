"""`rv stop RUN... | --all`: end runs: the current segment is cancelled and the chain goes no further.
A sweep's name stops every point of it that has not ended; SWEEP/INDEX one point."""

from __future__ import annotations

import click

from rv.cli.common import note, print_json, run_store, session, warn


@click.command()
@click.argument("runs", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Stop every live run rv submitted with this profile.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before stopping with --all.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what was stopped as JSON: per run, the jobs cancelled, whether its secrets were removed, "
    "and an error if any.",
)
@click.pass_context
def stop(ctx: click.Context, runs: tuple[str, ...], all_: bool, yes: bool, as_json: bool) -> None:
    """Stop RUNs (names, run ids or job ids of any segment; a sweep's name: all its points), or --all."""
    from rv.errors import UsageError
    from rv.job import query
    from rv.job.cleanup import stop_runs

    if not runs and not all_:
        raise UsageError("name the runs to stop, or pass --all", hint="rv stop NAME   rv stop --all")
    if runs and all_:
        raise UsageError("give runs or --all, not both")
    store = run_store()
    sweeps: dict[str, tuple[int, set[str]]] = {}  # a sweep named: (its points, the ones stopped now)
    with session(ctx) as s:
        if all_:
            snap = query.fetch(s.transport, s.layout.root, live=True)
            live_ids = {j.job_id for j in snap.queued}
            targets = [(r.run_id, r.name) for r in snap.runs if set(r.jobs) & live_ids]
            if not targets:
                if as_json:
                    print_json([])
                note("no live runs")
                return
            listing = ", ".join(name for _, name in targets)
            if not yes and not click.confirm(f"Stop {len(targets)} run(s): {listing}?", err=True):
                ctx.exit(1)
        else:
            targets = []
            for ref in runs:
                found, is_sweep = query.resolve_or_sweep(
                    s.transport, store, s.profile.name, s.layout.root, ref
                )
                if is_sweep:
                    going = [r for r in found if r.ended is None]
                    sweeps[ref] = (len(found), {r.run_id for r in going})
                    found = going
                targets += [(r.run_id, r.name) for r in found]
            if not targets:
                if as_json:
                    print_json([])
                note(f"every point of {', '.join(sweeps)} has ended already: nothing to stop")
                return
        stopped = stop_runs(s.transport, s.layout.root, targets)
    store.update_many(s.profile.name, {row.run_id: {"secrets_cleared": True} for row in stopped})
    if as_json:
        from dataclasses import asdict

        print_json([{**asdict(row), "cancelled": list(row.cancelled)} for row in stopped])
    in_sweeps = {run_id for _, ids in sweeps.values() for run_id in ids}
    for name, (total, ids) in sweeps.items():
        rows = [row for row in stopped if row.run_id in ids]
        cancelled = [job for row in rows for job in row.cancelled]
        for row in rows:
            if row.error:
                warn(f"point {row.name}: {row.error}")
        note(
            f"stopped sweep {name}: {len(rows)} of its {total} point(s) had not ended; "
            f"cancelled {len(cancelled)} job(s); they will not continue"
        )
    for row in stopped:
        if row.run_id in in_sweeps:
            continue
        if row.error:
            warn(f"run {row.name}: {row.error}")
        jobs = (
            f"cancelled job {', '.join(row.cancelled)}" if row.cancelled else "nothing was queued or running"
        )
        secrets = "; its secrets are removed" if row.secrets_removed else ""
        note(f"stopped run {row.name}: {jobs}; it will not continue{secrets}")
