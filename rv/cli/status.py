"""`rv status [--json]`: connection, account, what rv keeps by kind, your jobs, free GPUs per type."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import click

from rv.cli.common import print_json, session, warn


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """How the cluster and your jobs stand, and what rv keeps there (and what `rv gc` would free)."""
    from rv.slurm.client import cluster_status
    from rv.slurm.parse import availability_by_type

    with session(ctx) as s:
        started = time.monotonic()
        s.transport.connect()
        connect_ms = (time.monotonic() - started) * 1000
        # One round trip, however many jobs are queued: squeue, sinfo, storage, gc's estimate, sweep.
        st = cluster_status(s.transport, s.layout.root, older_than=14 * 86400, sweep=s.sweep_along())
        s.swept(st.sweep)
        kept = st.usage
        catalog = s.profile.gpu_catalog()
    for what, error in (("squeue", st.squeue_error), ("sinfo", st.sinfo_error)):
        if error:
            warn(f"{what} failed on the cluster, so what it tells is missing below: {error}")
    from rv.job.footprint import read_quota_report
    from rv.probe import parse_associations, parse_partitions, usable_lines

    associations = parse_associations(st.associations_text)
    accounts = list(dict.fromkeys(a for a, *_ in associations))
    partitions = parse_partitions(st.partitions_text)
    may_use = usable_lines(accounts, associations, partitions)
    gpus = availability_by_type(st.nodes, catalog)
    jobs = Counter(j.state for j in st.jobs)
    quota = read_quota_report(kept["quota"])
    data = {
        "profile": s.profile.name,
        "host": s.profile.host,
        "user": st.user,
        "connect_ms": round(connect_ms, 1),
        "round_trip_ms": round(st.round_trip_ms, 1),
        "account": s.profile.account,
        "remote_root": s.layout.root,
        "storage_bytes": kept["total"],
        "storage_by_kind": kept["kinds"],
        "storage_files": kept["files_total"],
        "storage_files_by_kind": kept["files"],
        "quota": [dataclasses.asdict(q) | {"root": q in quota.root} for q in quota.quotas],
        "quota_errors": list(quota.errors),
        "gc_would_free": kept["gc"],
        "git": st.git,
        "jobs": dict(jobs),
        "may_use": {
            "accounts": accounts,
            "qos": list(dict.fromkeys(q for *_, allowed in associations for q in allowed)),
            "partitions": list(partitions),
        },
        "gpus": {
            name: {"idle": idle, "total": total, "partition": catalog[name].partition}
            for name, (idle, total) in gpus.items()
        },
    }
    if as_json:
        print_json(data)
        return
    from rv.units import human_size

    size = human_size(kept["total"])
    click.echo(
        f"{st.user}@{s.profile.host} ({s.profile.name}): connected in {connect_ms:.0f} ms, "
        f"round trip {st.round_trip_ms:.0f} ms"
    )
    click.echo(f"account      {s.profile.account or '-'}")
    for label, text in may_use:
        click.echo(f"{label:<12} {text}")
    click.echo(f"storage      {size} in {kept['files_total']:,} files under {s.layout.root}")
    kinds = ", ".join(
        f"{kind} {human_size(n)} ({kept['files'][kind]:,} files)" for kind, n in kept["kinds"].items() if n
    )
    click.echo(f"  by kind    {kinds or 'nothing yet'}")
    for line in quota_lines(quota):
        click.echo(line)
    gc = kept["gc"]
    if "error" in gc:
        click.echo(f"  rv gc      cannot tell: {gc['error']}")
    else:
        click.echo(
            f"  rv gc      would free {human_size(gc['bytes_freed'])} in {gc['files_freed']:,} files "
            f"({gc['runs']} ended run(s) older than "
            f"14 days, {gc['snapshots']} snapshot(s), {gc['objects']} object(s))"
        )
    if st.git.get("problem"):
        warn(st.git["problem"])
    elif st.git.get("version"):
        click.echo(
            f"git          {st.git['version']} on the login node (jobs need git on the compute nodes too)"
        )
    click.echo("jobs         " + (", ".join(f"{n} {state.lower()}" for state, n in jobs.items()) or "none"))
    click.echo("GPUs         idle/total")
    for name, (idle, total) in sorted(gpus.items(), key=lambda kv: -kv[1][0]):
        click.echo(f"  {name:<10} {idle:>3}/{total:<3} {catalog[name].partition}")


def quota_lines(report) -> list[str]:  # type: ignore[no-untyped-def]
    """The site's quota, a line per filesystem (the remote root's marked), or why there is none."""
    from rv.units import human_size

    if not report.quotas:
        why = "; ".join(report.errors) or "no quota tool on the login node (lfs, mmlsquota, quota)"
        return [f"quota        not known: {why}"]
    lines = []
    for q in report.quotas:
        files = f"{q.files_used:,}" if q.files_used is not None else "?"
        share = f" ({q.files_share:.0%})" if q.files_share is not None else ""
        files += f" of {q.files_limit:,} files{share}" if q.files_limit else " files (no limit)"
        size = human_size(q.bytes_used) if q.bytes_used is not None else "?"
        size += f" of {human_size(q.bytes_limit)}" if q.bytes_limit else ""
        mark = "  (rv's files)" if q in report.root else ""
        lines.append(f"quota        {q.filesystem}: {files}, {size} ({q.tool}){mark}")
    return lines
