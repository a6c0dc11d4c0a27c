"""`rv status [--json]`: connection, account, storage, your jobs by state, free GPUs per type."""

from __future__ import annotations

import time
from collections import Counter

import click

from rv.cli.common import print_json, session


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def status(ctx: click.Context, as_json: bool) -> None:
    """One round trip: how the cluster and your jobs stand."""
    from rv.slurm.client import cluster_status
    from rv.slurm.parse import availability_by_type

    with session(ctx) as s:
        started = time.monotonic()
        s.transport.connect()
        connect_ms = (time.monotonic() - started) * 1000
        st = cluster_status(s.transport, s.layout.root)
        catalog = s.profile.gpu_catalog()
    gpus = availability_by_type(st.nodes, catalog)
    jobs = Counter(j.state for j in st.jobs)
    data = {
        "profile": s.profile.name,
        "host": s.profile.host,
        "user": st.user,
        "connect_ms": round(connect_ms, 1),
        "round_trip_ms": round(st.round_trip_ms, 1),
        "account": s.profile.account,
        "remote_root": s.layout.root,
        "storage_bytes": st.storage_bytes,
        "jobs": dict(jobs),
        "gpus": {
            name: {"idle": idle, "total": total, "partition": catalog[name].partition}
            for name, (idle, total) in gpus.items()
        },
    }
    if as_json:
        print_json(data)
        return
    size = "?" if st.storage_bytes is None else f"{st.storage_bytes / 2**30:.2f} GiB"
    click.echo(
        f"{st.user}@{s.profile.host} ({s.profile.name}): connected in {connect_ms:.0f} ms, "
        f"round trip {st.round_trip_ms:.0f} ms"
    )
    click.echo(f"account      {s.profile.account or '-'}")
    click.echo(f"storage      {size} under {s.layout.root}")
    click.echo("jobs         " + (", ".join(f"{n} {state.lower()}" for state, n in jobs.items()) or "none"))
    click.echo("GPUs         idle/total")
    for name, (idle, total) in sorted(gpus.items(), key=lambda kv: -kv[1][0]):
        click.echo(f"  {name:<10} {idle:>3}/{total:<3} {catalog[name].partition}")
