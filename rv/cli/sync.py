"""`rv sync push|pull|watch|snapshot` (and `gc`, the same as `rv gc`): files to and from the cluster."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from rv.cli.common import note, print_json, progress_renderer, session, warn


def _cache_dir() -> Path:
    from rv.config import cache_dir

    return cache_dir()


def _size(ctx: click.Context, param: click.Parameter, value: str) -> int:
    from rv.units import parse_size

    return parse_size(value)


size_options = [
    click.option(
        "--max-file-size",
        default="100MB",
        show_default=True,
        callback=_size,
        help="Refuse files bigger than this (e.g. 100MB, 2GB).",
    ),
    click.option("--allow-large", is_flag=True, help="Send files over --max-file-size anyway."),
]


def with_size_options(f: Any) -> Any:
    for option in reversed(size_options):
        f = option(f)
    return f


class _Lazy:
    """Connects on first use, so local checks (listing, size limits) fail before any network call."""

    def __init__(self, s: Any) -> None:
        self._session = s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session.transport, name)


class _SyncGroup(click.Group):
    """`rv sync gc` is `rv gc` (the name it had before runs had their own cleanup): found in rv's
    command table when asked for, as `rv gc` is."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), "gc"])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "gc":
            from rv.commands import load

            gc = load("gc")
            return gc if isinstance(gc, click.Command) else None
        return super().get_command(ctx, cmd_name)


@click.group(cls=_SyncGroup)
def sync() -> None:
    """Push, pull and watch files; collect garbage on the cluster.

    \b
    Relative REMOTE paths are under the profile's remote root; use ~/... for the home folder.
    """


@sync.command()
@click.argument("local", required=False, type=click.Path(exists=True, file_okay=False))
@click.argument("remote", required=False)
@click.option("--dry-run", "-n", is_flag=True, help="Show what would be done, change nothing.")
@click.option("--force", is_flag=True, help="Allow deleting files in a REMOTE outside the rv workspaces.")
@with_size_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan and result as JSON.")
@click.pass_context
def push(
    ctx: click.Context,
    local: str | None,
    remote: str | None,
    dry_run: bool,
    force: bool,
    max_file_size: int,
    allow_large: bool,
    as_json: bool,
) -> None:
    """Mirror LOCAL (default: this repo) into REMOTE (default: the branch's workspace).

    Files are chosen as for a snapshot (tracked plus untracked-not-ignored, minus .rvignore).
    Files gone here are deleted there, except what .gitignore/.rvignore match (job outputs survive).
    """
    from rv.files import sync as core

    with session(ctx) as s, progress_renderer("uploading") as bar:
        result = core.push(
            _Lazy(s),
            s.layout,
            local,
            remote,
            dry_run=dry_run,
            force=force,
            max_file_size=max_file_size,
            allow_large=allow_large,
            cache_dir=_cache_dir(),
            on_progress=bar,
        )
    for w in result.warnings:
        warn(w)
    plan = result.plan
    if as_json:
        print_json(
            {
                "local": str(result.local),
                "remote": result.remote_resolved,
                "dry_run": dry_run,
                "applied": result.applied,
                "plan": plan.to_json(),
            }
        )
    elif dry_run:
        for line in plan.lines():
            click.echo(line)
    verb = "would push" if dry_run else "pushed"
    if plan.empty:
        note(f"{result.remote_resolved}: up to date ({plan.unchanged} files)")
    else:
        note(f"{verb} to {result.remote_resolved}: {plan.summary()}")


@sync.command()
@click.argument("remote")
@click.argument("local", required=False, type=click.Path())
@click.option("--force", is_flag=True, help="Overwrite local files changed since they were last pulled.")
@click.option(
    "--keep-local", is_flag=True, help="Keep local files changed since the last pull; pull the rest."
)
@click.option("--json", "as_json", is_flag=True, help="Print what was transferred as JSON.")
@click.pass_context
def pull(
    ctx: click.Context, remote: str, local: str | None, force: bool, keep_local: bool, as_json: bool
) -> None:
    """Download REMOTE (a file or folder) to LOCAL (default: ./its name), sending only what differs.

    A local file that changed since rv last pulled it (or that rv never pulled) is not overwritten:
    the pull stops before changing anything and lists them; --force overwrites them, --keep-local
    keeps them and pulls everything else. Each file lands whole (temp file, then rename).
    """
    from rv.config import state_dir
    from rv.errors import UsageError
    from rv.files import pull as core

    if force and keep_local:
        raise UsageError("--force and --keep-local contradict each other", hint="pick one")
    on_conflict = "force" if force else "keep-local" if keep_local else "refuse"
    ledger = core.PullLedger(state_dir() / "pulled.json")
    with session(ctx) as s, progress_renderer("downloading") as bar:
        result = core.pull(
            s.transport, s.layout, remote, local, on_progress=bar, on_conflict=on_conflict, ledger=ledger
        )
    for w in result.warnings:
        warn(w)
    if as_json:
        print_json(
            {
                "remote": result.remote,
                "local": str(result.local),
                "downloaded": result.downloaded,
                "downloaded_bytes": result.downloaded_bytes,
                "same_content": result.same_content,
                "unchanged": result.unchanged,
                "kept_local": list(result.kept_local),
                "overwritten": list(result.overwritten),
            }
        )
    from rv.units import human_size

    if result.kept_local:
        shown = ", ".join(result.kept_local[:10])
        note(f"kept {len(result.kept_local)} local file(s) changed since the last pull: {shown}")
    if result.overwritten:
        note(f"overwrote {len(result.overwritten)} local file(s): {', '.join(result.overwritten[:10])}")
    note(
        f"pulled {remote} to {result.local}: {result.downloaded} file(s) "
        f"({human_size(result.downloaded_bytes)}), {result.unchanged + result.same_content} unchanged"
    )


@sync.command()
@click.argument("local", required=False, type=click.Path(exists=True, file_okay=False))
@click.argument("remote", required=False)
@click.option("--interval", default=0.5, show_default=True, help="Seconds between checks for changes.")
@click.option(
    "--debounce", default=0.5, show_default=True, help="Seconds the files must be still before a push."
)
@click.option("--force", is_flag=True, help="Allow deleting files in a REMOTE outside the rv workspaces.")
@with_size_options
@click.pass_context
def watch(
    ctx: click.Context,
    local: str | None,
    remote: str | None,
    interval: float,
    debounce: float,
    force: bool,
    max_file_size: int,
    allow_large: bool,
) -> None:
    """Push now and again on every change, until Ctrl-C (same arguments as push)."""
    from rv.files import sync as core

    with session(ctx) as s:

        def push_once(cache: Any) -> Any:
            return core.push(
                _Lazy(s),
                s.layout,
                local,
                remote,
                force=force,
                max_file_size=max_file_size,
                allow_large=allow_large,
                cache_dir=_cache_dir(),
                cache=cache,
            )

        def on_push(result: Any) -> None:
            stamp = time.strftime("%H:%M:%S")
            if result.plan.empty:
                note(f"{stamp} {result.remote_resolved}: up to date")
            else:
                note(f"{stamp} pushed: {result.plan.summary()}")

        def on_error(exc: Exception) -> None:
            warn(f"push failed, still watching: {exc}")

        note("watching for changes; Ctrl-C to stop")
        try:
            core.watch(
                push_once,
                lambda cache: core.tree_id(local, cache=cache),
                interval=interval,
                debounce=debounce,
                on_push=on_push,
                on_error=on_error,
            )
        except KeyboardInterrupt:
            note("stopped")


@sync.command()
@click.argument("path", required=False, default=".", type=click.Path(exists=True, file_okay=False))
@with_size_options
@click.option("--json", "as_json", is_flag=True, help="Print the snapshot's id, path and provenance as JSON.")
@click.pass_context
def snapshot(ctx: click.Context, path: str, max_file_size: int, allow_large: bool, as_json: bool) -> None:
    """Make (or find) the snapshot `rv run` would use for PATH's repo and print its id.

    The cluster side starts while the files are listed; a file over the size limit still stops it
    before anything is sent.
    """
    from rv.files.snapshot import make_snapshot, snapshot_warnings

    def prepared(snap: Any) -> None:
        for w in snapshot_warnings(snap):
            warn(w)

    with session(ctx) as s, progress_renderer("uploading") as bar:
        # Connecting (ssh -G, the warm connection) happens in make_snapshot's first call, on its own
        # thread, while this one lists the files.
        result = make_snapshot(
            _Lazy(s), s.layout, path, max_file_size=max_file_size, allow_large=allow_large,
            cache_dir=_cache_dir(), cache_key=f"{s.profile.name}:{s.layout.root}", on_summary=note,
            on_progress=bar, on_prepared=prepared,
        )  # fmt: skip
    if as_json:
        print_json(
            {
                "id": result.id,
                "remote_path": result.remote_path,
                "meta_path": result.meta_path,
                "base": result.base,
                "snapshot_commit": result.snapshot_commit,
                "ref": result.ref,
                "project": result.project,
                "branch": result.branch,
                "commit": result.commit,
                "dirty": result.dirty,
                "subdir": result.subdir,
                "created": result.created,
                "files": result.files,
                "total_bytes": result.total_bytes,
                "new_objects": result.new_objects,
                "new_bytes": result.new_bytes,
                "left_out": [{"path": p, "size": n if n >= 0 else None} for p, n in result.ignored],
                "warnings": list(result.warnings),
            }
        )
    else:
        click.echo(result.id)
