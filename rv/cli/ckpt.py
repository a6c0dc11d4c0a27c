"""`rv ckpt ls [RUN]`, `rv ckpt pull RUN[@STEP] [LOCAL]`: a run's checkpoints, at hand."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from rv.cli.common import note, print_json, progress_renderer, run_store, session


@click.group()
def ckpt() -> None:
    """List and download a run's checkpoints (rv_train's step_<N> layout, or any files)."""


def _listing(s, ref: str | None):  # type: ignore[no-untyped-def]
    from rv.job import query
    from rv.remote.agent_client import call_agent

    found = query.resolve(s.transport, run_store(), s.profile.name, s.layout.root, ref)
    meta = found.run.meta
    root = found.record.remote_root if found.record else s.layout.root
    args = {"root": root, "project": meta["project"], "name": meta["name"]}
    return found.run, root, call_agent(s.transport, "ckpt-ls", args)


def render_listing(listing: dict[str, Any]) -> list[str]:
    """Pure: the `rv ckpt ls` table."""
    from rv.units import human_size

    if not listing["exists"]:
        return ["no checkpoint folder yet"]
    lines = [f"{'STEP':>8}  {'SIZE':>9}  {'SAVED':<19}  STATE"]
    for step in listing["steps"]:
        state = "complete" if step["complete"] else "incomplete (never loaded)"
        if step["step"] == listing.get("resume_step"):
            state += "  <- a resume starts here"
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(step["mtime"])) if step["mtime"] else "-"
        lines.append(f"{step['step']:>8}  {human_size(step['bytes']):>9}  {saved:<19}  {state}")
    if not listing["steps"]:
        lines.append(
            f"{listing['files']} file(s), {human_size(listing['bytes'])} (not rv_train's step_<N> layout)"
        )
    if listing.get("marker"):
        lines.append(f"PREEMPTED marker: {listing['marker'][:200]}")
    return lines


@ckpt.command("ls")
@click.argument("run", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def ls(ctx: click.Context, run: str | None, as_json: bool) -> None:
    """What RUN's checkpoint folder holds: steps, sizes, times, complete or not, which one resumes."""
    with session(ctx) as s:
        found, _, listing = _listing(s, run)
    if as_json:
        print_json(listing)
        return
    note(f"checkpoints of run {found.name} ({found.meta['project']}/{found.meta['name']}):")
    for line in render_listing(listing):
        click.echo(line)


@ckpt.command("pull")
@click.argument("spec", metavar="RUN[@STEP]")
@click.argument("local", required=False)
@click.pass_context
def pull(ctx: click.Context, spec: str, local: str | None) -> None:
    """Download RUN's newest complete checkpoint (at or before STEP) to LOCAL (default ./checkpoints/RUN/)."""
    from rv.agent import layout as remote_layout
    from rv.errors import NotFound
    from rv.files import pull as core
    from rv.job.submit import FromRun
    from rv.layout import RemoteLayout

    wanted = FromRun.parse(spec)
    with session(ctx) as s:
        found, root, listing = _listing(s, wanted.run)
        steps = [st for st in listing["steps"] if st["complete"]]
        if wanted.step is not None:
            steps = [st for st in steps if st["step"] <= wanted.step]
        base = remote_layout.checkpoint_dir(found.meta["project"], found.meta["name"])  # under the root
        if steps:
            remote, label = f"{base}/{steps[-1]['name']}", f"step {steps[-1]['step']}"
        elif listing["steps"] or wanted.step is not None or not listing["exists"]:
            at = "" if wanted.step is None else f" at or before step {wanted.step}"
            raise NotFound(
                f"run {found.name} has no complete checkpoint{at}", hint=f"rv ckpt ls {found.name}"
            )
        else:
            remote, label = base, "all its checkpoint files"
        dest = Path(local) if local else Path("checkpoints") / found.name / remote.rsplit("/", 1)[-1]
        with progress_renderer("receiving") as progress:
            result = core.pull(s.transport, RemoteLayout(root), remote, dest, on_progress=progress)
    from rv.units import human_size

    got = f"{result.downloaded} file(s), {human_size(result.downloaded_bytes)}"
    note(f"pulled {label} of run {found.name} to {dest}/: {got} ({result.unchanged} already there)")
