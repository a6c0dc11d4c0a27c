"""`rv stop RUN... | --all`: end runs: the current segment is cancelled and the chain goes no further."""

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
    """Stop RUNs (names, run ids or job ids of any segment), or --all of yours."""
    from rv.errors import UsageError
    from rv.job import query
    from rv.job.cleanup import stop_runs

    if not runs and not all_:
        raise UsageError("name the runs to stop, or pass --all", hint="rv stop NAME   rv stop --all")
    if runs and all_:
        raise UsageError("give runs or --all, not both")
    store = run_store()
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
                found = query.resolve(s.transport, store, s.profile.name, s.layout.root, ref)
                targets.append((found.run.run_id, found.run.name))
        stopped = stop_runs(s.transport, s.layout.root, targets)
    store.update_many(s.profile.name, {row.run_id: {"secrets_cleared": True} for row in stopped})
    if as_json:
        from dataclasses import asdict

        print_json([{**asdict(row), "cancelled": list(row.cancelled)} for row in stopped])
    for row in stopped:
        if row.error:
            warn(f"run {row.name}: {row.error}")
        jobs = (
            f"cancelled job {', '.join(row.cancelled)}" if row.cancelled else "nothing was queued or running"
        )
        secrets = "; its secrets are removed" if row.secrets_removed else ""
        note(f"stopped run {row.name}: {jobs}; it will not continue{secrets}")
