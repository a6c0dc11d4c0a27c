"""`rv why [RUN] [--json]`: why a run waits (and what would start it sooner), or why it ended."""

from __future__ import annotations

import click

from rv.cli.common import print_json, run_store, session


def render(why) -> list[str]:  # type: ignore[no-untyped-def]  # rv.job.why.Why; pure: lines out
    from rv.timespec import format_elapsed

    lines = [f"{why.run}: {why.summary}"]
    for w in why.waiting:
        what = f"job {w.job_id}" + (f" ({w.gpu_type})" if w.gpu_type else "")
        lines.append(f"  {what}, partition {w.partition}{f', QoS {w.qos}' if w.qos else ''}:")
        lines.append(f"    why: {w.words}" + (f" (Slurm: {w.code})" if w.code.strip() != "None" else ""))
        if w.limit:
            lines.append(f"    limit: {w.limit}")
        ahead = (
            f"{len(w.ahead)} pending job(s) of higher priority"
            if w.ahead
            else "no pending job of higher priority"
        )
        if w.ahead:
            shown = ", ".join(w.ahead[:5]) + (" ..." if len(w.ahead) > 5 else "")
            ahead += f" ({shown})"
        lines.append(f"    ahead of it in {w.partition}: {ahead}; {w.running} running")
        if w.expected_in_s is not None:
            lines.append(f"    Slurm expects it to start in {format_elapsed(max(0, w.expected_in_s))}")
        else:
            lines.append("    Slurm has no expected start for it yet")
        for note in w.notes:
            lines.append(f"    note: {note}")
        for s in w.suggestions:
            at = ""
            if s.sooner and s.estimate is not None and w.expected_start is not None:
                gain = format_elapsed(max(0, w.expected_start - s.estimate))
                at = f", and expects it to start {gain} sooner"
            lines.append(f"    try {s.change}: {s.why} (sbatch --test-only accepts it{at})")
        if not w.suggestions:
            lines.append("    nothing rv can suggest that sbatch --test-only accepts")
    if why.details and not why.waiting:
        lines += [f"  {line}" for line in why.details]
    return lines


@click.command()
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the answer as JSON.")
@click.pass_context
def why(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """Why RUN (default: the latest) is pending, in words, and what would start it sooner (each
    checked with sbatch --test-only); or why it ended."""
    from rv.cli.common import load_profile
    from rv.job import query
    from rv.job import why as core

    _, profile = load_profile(ctx)
    catalog = profile.gpu_catalog()
    with session(ctx) as s:
        found = query.resolve(s.transport, run_store(), s.profile.name, s.layout.root, run)
        cluster_run, listing = found.run, found.listing
        pending = core.pending_jobs(cluster_run, listing.queued)
        waiting: list[core.Waiting] = []
        if pending:
            listing = core.gather(s.transport, s.layout.root, cluster_run, pending)
            runs = [r for r in listing.runs if r.run_id == cluster_run.run_id]
            cluster_run = runs[0] if runs else cluster_run
            pending = core.pending_jobs(cluster_run, listing.queued) or pending
            waiting = core.explain_pending(
                cluster_run, pending, listing.slurm, now=listing.now, catalog=catalog
            )
            waiting = core.check(s.transport, s.layout.root, cluster_run.run_id, waiting)
        answer = core.explain(cluster_run, listing, waiting)
    if as_json:
        print_json(answer.to_json())
        return
    for line in render(answer):
        click.echo(line)
