"""`rv ps [-a] [--json]` (alias `ls`): your jobs, live from squeue and finished from sacct."""

from __future__ import annotations

import click

from rv.cli.common import print_json, session, warn


def _duration(seconds: int | None) -> str:
    if seconds is None:
        return "-"
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{d}-" if d else "") + f"{h:d}:{m:02d}:{s:02d}"


def job_rows(snapshot, records) -> list[dict]:  # type: ignore[no-untyped-def]
    """One row per job, newest first: live jobs win over sacct's (possibly lagging) view."""
    by_id = {r.job_id: r for r in records}
    rows: dict[str, dict] = {}
    for j in snapshot.finished:
        rows[j.job_id] = {
            "id": j.job_id, "name": j.name, "state": j.state, "exit_code": j.exit_code,
            "exit_signal": j.exit_signal, "gpus": j.gpus, "gpu_type": j.gpu_type, "nodes": j.nodes,
            "node_list": list(j.node_list), "elapsed_seconds": j.elapsed_seconds, "reason": j.reason,
            "start": j.start, "partition": j.partition,
        }  # fmt: skip
    for j in snapshot.live:
        rows[j.job_id] = {
            "id": j.job_id, "name": j.name, "state": j.state,
            "exit_code": rows.get(j.job_id, {}).get("exit_code"), "exit_signal": None, "gpus": j.gpus,
            "gpu_type": j.gpu_type, "nodes": j.nodes, "node_list": list(j.node_list),
            "elapsed_seconds": j.elapsed_seconds, "reason": j.reason, "start": j.start,
            "partition": j.partition,
        }  # fmt: skip
    for row in rows.values():
        record = by_id.get(row["id"])
        row["rv"] = record is not None
        row["branch"] = record.branch if record else None
        row["commit"] = record.commit if record else None
        row["dirty"] = record.dirty if record else None
        row["source"] = record.short_commit if record else "-"

    def key(row: dict) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else 0 for p in row["id"].replace("_", ".").split("."))

    return sorted(rows.values(), key=key, reverse=True)


@click.command()
@click.option("-a", "--all", "all_", is_flag=True, help="Include finished jobs (last 7 days, from sacct).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ps(ctx: click.Context, all_: bool, as_json: bool) -> None:
    """List your jobs: id, name, state, GPUs, nodes, elapsed, branch@commit, pending reason."""
    from rv.config import state_dir
    from rv.jobs import JobStore
    from rv.slurm.client import list_jobs

    with session(ctx) as s:
        snapshot = list_jobs(s.transport, include_finished=all_)
        records = JobStore(state_dir() / "jobs.json").all(s.profile.name)
    if snapshot.sacct_error:
        warn(f"sacct failed, finished jobs are missing: {snapshot.sacct_error}")
    rows = job_rows(snapshot, records)
    if as_json:
        print_json(rows)
        return
    header = (
        f"{'ID':<10} {'NAME':<18} {'STATE':<11} {'EXIT':>4} {'GPUS':<10} {'NODES':>5} {'ELAPSED':>10}  SOURCE"
    )
    click.echo(header)
    for r in rows:
        gpus = f"{r['gpus']}x{r['gpu_type']}" if r["gpus"] and r["gpu_type"] else str(r["gpus"] or "-")
        exit_ = "-" if r["exit_code"] is None else str(r["exit_code"])
        reason = f"  ({r['reason']})" if r["state"] == "PENDING" and r["reason"] else ""
        click.echo(
            f"{r['id']:<10} {r['name'][:18]:<18} {r['state']:<11} {exit_:>4} {gpus:<10} {r['nodes']:>5} "
            f"{_duration(r['elapsed_seconds']):>10}  {r['source']}{reason}"
        )
