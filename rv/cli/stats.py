"""`rv stats [RUN] [--json]`: what a run (or each point of a sweep) used and cost, from what its jobs
measured on every node (rv.agent.stats), with advice (rv.job.stats)."""

from __future__ import annotations

import time

import click

from rv.cli.common import print_json, run_store, session


@click.command()
@click.argument("run", required=False)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the figures as JSON: cpu_efficiency (0-1), peak_memory_bytes, gpus, su, segments, advice.",
)
@click.pass_context
def stats(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """What RUN used and cost (default: the latest run; a sweep's name: each point and the total).

    Per segment and for the run: wall time, GPUs and type, CPU efficiency (CPU seconds over cores
    allocated × the program's wall time), peak memory per node against --mem, each GPU's utilization
    (mean, max) and peak memory, and SUs (the catalog's rate × GPUs × hours; "?" and why where the
    catalog has no rate). Measured by the job itself, on every node; GPU figures where the node has
    nvidia-smi (sampled every 30 s and at the end)."""
    from rv.job import query
    from rv.job import stats as core

    store = run_store()
    with session(ctx) as s:
        catalog = s.profile.gpu_catalog()
        if run is None:
            found, is_sweep = (
                [query.resolve(s.transport, store, s.profile.name, s.layout.root, None).run],
                False,
            )
        else:
            found, is_sweep = query.resolve_or_sweep(s.transport, store, s.profile.name, s.layout.root, run)
        # A run this machine sent under another remote root is read there (as `rv logs` does).
        local = store.resolve(run, s.profile.name)
        root = local.remote_root if local is not None and not is_sweep else s.layout.root
        snap = query.fetch(s.transport, root, ids=[r.run_id for r in found], stats=0)
    now = snap.now or time.time()
    fresh = {r.run_id: r for r in snap.runs}
    figures = [
        core.run_stats(fresh.get(r.run_id, r), snap.stats.get(r.run_id) or {}, catalog, now) for r in found
    ]
    if as_json:
        if is_sweep:
            sus = [f.su for f in figures]
            print_json({
                "sweep": run, "points": [core.to_json(f) for f in figures],
                "su": None if any(x is None for x in sus) else round(sum(x or 0.0 for x in sus), 2),
                "wall_seconds": round(sum(f.wall_seconds for f in figures), 1),
            })  # fmt: skip
        else:
            print_json(core.to_json(figures[0]))
        return
    if is_sweep:
        points = [
            (int((r.meta.get("sweep") or {}).get("index") or 0), f)
            for r, f in zip(found, figures, strict=True)
        ]
        lines = core.render_sweep(run or "", points)
    else:
        lines = core.render(figures[0])
    for line in lines:
        click.echo(line)
