"""`rv stop JOB... | --all`: cancel jobs."""

from __future__ import annotations

import shlex

import click

from rv.cli.common import note, session


@click.command()
@click.argument("jobs", nargs=-1)
@click.option("--all", "all_", is_flag=True, help="Cancel every queued or running job rv submitted.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask before cancelling with --all.")
@click.pass_context
def stop(ctx: click.Context, jobs: tuple[str, ...], all_: bool, yes: bool) -> None:
    """Cancel JOBs (ids, id prefixes or names), or --all of yours."""
    from rv.config import state_dir
    from rv.errors import UsageError
    from rv.jobs import JobStore

    if not jobs and not all_:
        raise UsageError("name the jobs to stop, or pass --all", hint="rv stop 12345   rv stop --all")
    if jobs and all_:
        raise UsageError("give job ids or --all, not both")
    with session(ctx) as s:
        store = JobStore(state_dir() / "jobs.json")
        if all_:
            known = {r.job_id for r in store.all(s.profile.name)}
            live = s.transport.run('squeue --me -h -o %i 2>/dev/null || squeue -u "$(id -un)" -h -o %i')
            ids = [i for i in live.check("listing your jobs").out.split() if i.split("_")[0] in known]
            if not ids:
                note("no queued or running jobs submitted by rv")
                return
            if not yes and not click.confirm(f"Cancel {len(ids)} job(s): {' '.join(ids)}?", err=True):
                ctx.exit(1)
        else:
            ids = [store.resolve(j, s.profile.name).job_id for j in jobs]
        s.transport.run("scancel " + " ".join(shlex.quote(i) for i in ids)).check("scancel")
        note(f"cancelled {' '.join(ids)}")
