"""`rv gc` (also `rv sync gc`): remove what finished runs left, then what nothing references."""

from __future__ import annotations

from typing import Any

import click

from rv.cli.common import note, print_json, session, warn


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    from rv.timespec import parse_duration

    # Zero is a real answer here: everything that has ended, whatever its age.
    return float(parse_duration(value, flag="--older-than", allow_zero=True))


def summary(report: dict[str, Any]) -> str:
    """One line: what went (or would go), and the bytes, as measured on the cluster."""
    from rv.units import human_size

    verb = "would free" if report["dry_run"] else "freed"
    parts = [f"{len(report['runs_removed'])} run(s)"]
    if report.get("checkpoints_removed") or report.get("outputs_removed"):
        parts.append(
            f"{len(report['checkpoints_removed'])} checkpoint folder(s), {len(report['outputs_removed'])} "
            "output folder(s)"
        )
    parts.append(f"{len(report['removed'])} snapshot(s), {report['objects_removed']} object(s)")
    if report.get("envs_removed"):
        parts.append(f"{len(report['envs_removed'])} environment(s)")
    if report.get("images_removed"):
        parts.append(f"{len(report['images_removed'])} pulled image(s)")
    kept = report["runs_kept"]
    live = sum(1 for k in kept if k["why"].startswith("live"))
    freed = human_size(report["bytes_freed"])
    files = report.get("files_freed")
    freed += f" in {files:,} files" if files is not None else ""
    line = f"{verb} {freed}: {', '.join(parts)}; kept {len(kept)} run(s) ({live} live)"
    if report.get("store_files_after") is not None:
        # A file quota counts the store's files: what git's own gc did to them, measured.
        line += (
            f"; the store went from {report['store_files_before']:,} to {report['store_files_after']:,} files"
        )
    return line


@click.command()
@click.option(
    "--older-than",
    default="14d",
    show_default=True,
    callback=_duration,
    help="Remove what runs that ended longer ago than this left (e.g. 14d, 12h, 30m; 0: every run that "
    "has ended).",
)
@click.option("--checkpoints", is_flag=True, help="Also remove those runs' checkpoints and outputs.")
@click.option("--dry-run", "-n", is_flag=True, help="List what would go; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (bytes_freed, measured).")
@click.pass_context
def gc(ctx: click.Context, older_than: float, checkpoints: bool, dry_run: bool, as_json: bool) -> None:
    """Remove finished runs' work dirs, scripts, logs and records, then snapshots, objects, environments
    and pulled container images no run uses.

    Never anything of a live run. Checkpoints and outputs only with --checkpoints.
    """
    from rv.job.cleanup import collect_garbage
    from rv.units import human_size

    with session(ctx) as s:
        report = collect_garbage(
            s.transport, s.layout.root, older_than=older_than, checkpoints=checkpoints, dry_run=dry_run
        )
    for w in report.get("warnings", []):
        warn(w)
    for sid in report.get("broken_removed", []):
        warn(f"snapshot {sid} had lost objects (a purge, a damaged pack): removed; `rv run` sends it again")
    for repair in report.get("repairs", []):
        warn(f"the store: {repair}")
    if as_json:
        print_json(report)
    else:
        verb = "would remove" if dry_run else "removed"
        for row in report["runs_removed"]:
            why = f" ({row['reason']})" if row.get("reason") else ""
            click.echo(f"{verb}  run {row['name'] or '?'} {row['run_id']}{why}  {human_size(row['bytes'])}")
        for key, what in (("checkpoints_removed", "checkpoints"), ("outputs_removed", "outputs")):
            for row in report.get(key, []):
                click.echo(f"{verb}  {what} of {row['project']}/{row['name']}  {human_size(row['bytes'])}")
        for row in report["removed"]:
            # The git store's snapshots share objects: what they free together is in the summary.
            size = f"  {human_size(row['bytes'])}" if row.get("bytes") is not None else ""
            click.echo(f"{verb}  snapshot {row['id']}{size}")
        for row in report.get("envs_removed", []):
            click.echo(f"{verb}  environment {row['key']} ({row.get('files')})  {human_size(row['bytes'])}")
        for row in report.get("images_removed", []):
            click.echo(f"{verb}  image {row['reference']} ({row['key']})  {human_size(row['bytes'])}")
        for row in report.get("images_kept", []):
            click.echo(f"keep    image {row['reference']} ({row['key']}): {row['why']}")
        for row in report["runs_kept"]:
            click.echo(f"keep    run {row['name'] or '?'} {row['run_id']}: {row['why']}")
    note(summary(report))
