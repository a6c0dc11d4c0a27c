"""`rv status [--json]`: connection, account, what rv keeps by kind, your jobs, free GPUs per type."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Any

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
        # Every route's transport connects on its own at first use; rv status times that alone. The
        # Transport protocol (rv.remote.transport) has no connect of its own to call.
        s.transport.connect()  # type: ignore[attr-defined]
        connect_ms = (time.monotonic() - started) * 1000
        # One round trip, however many jobs are queued: squeue, sinfo, storage, gc's estimate, sweep.
        st = cluster_status(
            s.transport, s.layout.root, older_than=14 * 86400, sweep=s.sweep_along(), setup=s.profile.setup
        )
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
        # The site's quota tools' rows (rv.job.footprint); "root": the remote root's filesystem.
        "quota": [dataclasses.asdict(q) | {"root": q in quota.root} for q in quota.quotas],
        "quota_errors": list(quota.errors),
        "gc_would_free": kept["gc"],
        "git": st.git,
        "container_runtimes": st.runtimes,
        # Images pulled from registries (rv.agent.images): reference, size, the runs that name them.
        "container_images": kept.get("images") or [],
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
    if st.git.get("problem"):
        warn(st.git["problem"])
    for line in status_lines(data, may_use, catalog):
        click.echo(line)


def status_lines(data: dict[str, Any], may_use: list[tuple[str, str]], catalog: Any) -> list[str]:
    """`rv status`'s text, from the data its --json prints (plus the account lines and the catalog)."""
    from rv.units import count, human_size

    kept_kinds, gc, git = data["storage_by_kind"], data["gc_would_free"], data["git"]
    lines = [
        f"{data['user']}@{data['host']} ({data['profile']}): connected in {data['connect_ms']:.0f} ms, "
        f"round trip {data['round_trip_ms']:.0f} ms",
        f"account      {data['account'] or '-'}",
        *(f"{label:<12} {text}" for label, text in may_use),
        f"storage      {human_size(data['storage_bytes'])} in {count(data['storage_files'], 'file')} under "
        f"{data['remote_root']}",
    ]
    files = data["storage_files_by_kind"]
    kinds = ", ".join(
        f"{kind} {human_size(n)} ({count(files[kind], 'file')})" for kind, n in kept_kinds.items() if n
    )
    lines.append(f"  by kind    {kinds or 'nothing yet'}")
    lines += quota_lines(data["quota"], data["quota_errors"])
    if "error" in gc:
        lines.append(f"  rv gc      cannot tell: {gc['error']}")
    else:
        lines.append(
            f"  rv gc      would free {human_size(gc['bytes_freed'])} in {count(gc['files_freed'], 'file')} "
            f"({count(gc['runs'], 'ended run')} older than "
            f"14 days, {count(gc['snapshots'], 'snapshot')}, {count(gc['objects'], 'object')})"
        )
    if git.get("version") and not git.get("problem"):
        lines.append(
            f"git          {git['version']} on the login node (jobs need git on the compute nodes too)"
        )
    if git.get("background_gc_failed"):
        # A job's background gc failed: packs pile up until something mends the store.
        lines.append(
            f"  store gc   FAILED in a job: {git['background_gc_failed']} (`rv gc` repairs what it can)"
        )
    lines.append("containers   " + runtimes_text(data["container_runtimes"]))
    lines += image_lines(data.get("container_images") or [])
    jobs = data["jobs"]
    lines.append("jobs         " + (", ".join(f"{n} {state.lower()}" for state, n in jobs.items()) or "none"))
    lines.append("GPUs         idle/total")
    for name, counts in sorted(data["gpus"].items(), key=lambda kv: -kv[1]["idle"]):
        lines.append(f"  {name:<10} {counts['idle']:>3}/{counts['total']:<3} {catalog[name].partition}")
    return lines


def image_lines(images: list[dict[str, Any]]) -> list[str]:
    """Each image pulled into the cluster's cache: its reference, size, and the runs that name it."""
    from rv.units import human_size

    lines = []
    for im in images:
        runs = im.get("runs") or []
        live = [r["name"] for r in runs if r.get("live")]
        used = f"used by {len(runs)} run(s)" if runs else "used by no run"
        used += f" (live: {', '.join(live[:3])})" if live else ""
        size = human_size(im["bytes"])
        lines.append(f"  image      {im['reference']} ({im['runtime']}, {size}, {im['key']}): {used}")
    return lines


def runtimes_text(runtimes: dict[str, Any]) -> str:
    """The container runtimes on the login node after the profile's setup lines (rv run --container)."""
    from rv.agent.container import describe

    if "error" in runtimes:
        return f"cannot tell: {runtimes['error']}"
    found = runtimes.get("found") or {}
    return describe(found) if found else "none found (after the profile's setup lines)"


def quota_lines(quotas: list[dict[str, Any]], errors: list[str]) -> list[str]:
    """The site's quota, a line per filesystem (the remote root's marked), or why there is none."""
    from rv.units import count, human_size

    if not quotas:
        why = "; ".join(errors) or "no quota tool on the login node (lfs, mmlsquota, quota)"
        return [f"quota        not known: {why}"]
    lines = []
    for q in quotas:
        used, limit = q["files_used"], q["files_limit"]
        share = f" ({used / limit:.0%})" if limit and used is not None else ""
        if limit:
            files = f"{used:,}" if used is not None else "?"
            files += f" of {count(limit, 'file')}{share}"
        else:
            files = (count(used, "file") if used is not None else "? files") + " (no limit)"
        size = human_size(q["bytes_used"]) if q["bytes_used"] is not None else "?"
        size += f" of {human_size(q['bytes_limit'])}" if q["bytes_limit"] else ""
        mark = "  (rv's files)" if q["root"] else ""
        lines.append(f"quota        {q['filesystem']}: {files}, {size} ({q['tool']}){mark}")
    return lines
