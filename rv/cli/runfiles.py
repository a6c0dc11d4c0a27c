"""`rv diff RUN_A RUN_B` and `rv checkout RUN DIR | --branch NAME`: the code a run ran (rv.job.runfiles).

(`rv code`, the editor on a session's node, is rv.cli.code.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from rv.cli.common import load_profile, note, run_store, session


def _find(ctx: click.Context, refs: list[str], *, diff: bool):  # type: ignore[no-untyped-def]
    """(the runs' commits, their diff or b"", this machine's repository, where they were found)."""
    from rv.config import cache_dir
    from rv.files.gitcmd import Git
    from rv.job import runfiles

    _, profile = load_profile(ctx)
    repo = runfiles.local_repo(cache_dir(), Path.cwd(), Git())
    store = run_store()
    records = runfiles.resolve_records(store, profile.name, refs)
    runfiles.refuse_sweeps(refs, records, store, profile.name)
    found = runfiles.known_here(refs, records, repo)
    if found is not None and repo is not None:
        text = runfiles.diff_here(repo, found[0].commit, found[1].commit) if diff else b""
        return found, text, repo, None
    with session(ctx) as s:
        runs, text = runfiles.ask_cluster(s.transport, s.layout.root, refs, diff=diff)
    return runs, text, repo, s


@click.command()
@click.argument("run_a")
@click.argument("run_b")
@click.pass_context
def diff(ctx: click.Context, run_a: str, run_b: str) -> None:
    """Show what differs between the code RUN_A ran and RUN_B's, as `git diff` prints it.

    RUN is a run name (its newest run), a run id or a job id of any segment. From this machine's own
    repository of snapshots when it holds both, else in one call to the cluster's store.
    """
    runs, text, _repo, asked = _find(ctx, [run_a, run_b], diff=True)
    sys.stdout.buffer.write(text)
    sys.stdout.flush()
    a, b = runs
    where = "the cluster's store" if asked is not None else "this machine's repository of snapshots"
    same = "; the same files" if not text else ""
    note(f"rv diff: {a.name} (snapshot {a.snapshot[:12]}) to {b.name} (snapshot {b.snapshot[:12]}), "
         f"from {where}{same}")  # fmt: skip


@click.command()
@click.argument("run")
@click.argument("dest", required=False, type=click.Path(path_type=Path))
@click.option(
    "--branch", metavar="NAME",
    help="Make the run's files a commit on a new local branch NAME of this repository, and switch to it "
    "(never over uncommitted changes).",
)  # fmt: skip
@click.pass_context
def checkout(ctx: click.Context, run: str, dest: Path | None, branch: str | None) -> None:
    """Write the exact files RUN ran into DIR, a new folder (or, with --branch, a new branch here).

    Exec bits and symlinks are kept; nothing is converted. RUN is a run name, a run id or a job id.
    """
    from rv.errors import UsageError
    from rv.files.gitcmd import Git
    from rv.job import runfiles

    safe = run.replace("/", "-")
    if (dest is None) == (branch is None):
        raise UsageError(
            "rv checkout writes a run's files into a new folder DIR, or onto a new branch with --branch "
            "NAME: give one of them",
            hint=f"rv checkout {run} ./{safe}-code   or   rv checkout {run} --branch {safe}",
        )
    git = Git()
    top = None
    if dest is not None:
        runfiles.check_new_folder(dest)
    else:
        assert branch is not None
        top = runfiles.check_branch(Path.cwd(), git, branch, run)
    runs, _text, repo, asked = _find(ctx, [run], diff=False)
    (found,) = runs
    if dest is not None:
        top_made = runfiles.made_folder(dest)
        try:
            if asked is None and repo is not None:
                files = runfiles.checkout_here(repo, found.commit, dest)
            else:
                with session(ctx) as s:
                    files = runfiles.checkout_from_cluster(s.transport, s.layout.root, found, dest)
        except BaseException:
            runfiles.unmake_folder(dest, top_made)  # a checkout that fails leaves nothing behind
            raise
        note(f"wrote run {found.name}'s {files} file(s) (snapshot {found.snapshot[:12]}) into {dest}")
        return
    assert branch is not None and top is not None
    from rv.config import cache_dir
    from rv.files.packs import LocalStore, store_name

    local = repo or LocalStore(cache_dir() / "git" / store_name(top), git)
    if local.commit_of(found.snapshot) is None:
        with session(ctx) as s:
            runfiles.fetch_from_cluster(s.transport, s.layout.root, local, found)
    made = runfiles.make_branch(top, git, local, found, branch)
    note(f"on branch {branch}: commit {made[:12]} holds run {found.name}'s files "
         f"(snapshot {found.snapshot[:12]})")  # fmt: skip
