"""The code a run ran: ``rv diff RUN_A RUN_B`` and ``rv checkout RUN DIR``.

A run's snapshot is a git commit (rv.agent.store), so both are git's own work. From this machine's
repository of snapshots (rv.files.packs, under the cache folder) when it remembers the runs'
snapshots and holds all their objects: no connection at all. Otherwise one call asks the cluster's
store which commit each run ran (and for the diff); a checkout then streams ``git archive`` of the
commit, or, for ``--branch``, fetches its objects as one pack into rv's repository first.

``--branch NAME`` makes the run's files a commit of the user's own repository (its tree the
snapshot's, its parent the commit the run was made from when the repository has it) on a new
branch, and switches to it: only from a work tree without uncommitted changes, and never over an
existing branch.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rv.errors import NotFound, RemoteError, UsageError
from rv.files.gitcmd import Git
from rv.files.gitrepo import find_repo_top
from rv.files.packs import LocalStore, store_name
from rv.files.tmpdirs import temp_dir

if TYPE_CHECKING:
    from rv.job.records import RunRecord
    from rv.remote.transport import Transport


@dataclass(frozen=True)
class RunCode:
    """A run and the snapshot commit it ran."""

    ref: str  # as the user typed it
    name: str
    snapshot: str
    commit: str
    made_from: str | None = None  # the commit of the user's repository the run was made from


def local_repo(cache_dir: Path, here: Path, git: Git) -> LocalStore | None:
    """rv's repository of snapshots for the work tree around ``here``, if there is one."""
    top = find_repo_top(here, git)
    if top is None:
        return None
    return LocalStore.existing(cache_dir / "git" / store_name(top), git)


def known_here(
    refs: Sequence[str], records: Sequence[RunRecord | None], repo: LocalStore | None
) -> list[RunCode] | None:
    """Each run's commit from this machine alone (its records, its repository), or None."""
    if repo is None or any(r is None for r in records):
        return None
    found = []
    for ref, record in zip(refs, records, strict=True):
        assert record is not None
        commit = repo.commit_of(record.snapshot)
        if commit is None:
            return None
        found.append(RunCode(ref, record.name, record.snapshot, commit, record.commit))
    return found


def diff_here(repo: LocalStore, a: str, b: str) -> bytes:
    """``git diff A B`` of two snapshot commits, as git prints it (none of the user's settings)."""
    return repo.run(["diff", "--no-color", "--no-ext-diff", a, b]).stdout


def ask_cluster(
    transport: Transport, root: str, refs: Sequence[str], *, diff: bool
) -> tuple[list[RunCode], bytes]:
    """One call: each run's commit in the cluster's store (and their diff, when asked)."""
    from rv.remote.agent_client import call_agent

    reply = call_agent(transport, "snap-code", {"root": root, "refs": list(refs), "diff": diff}, timeout=300)
    runs = [
        RunCode(r["ref"], r.get("name") or r["run_id"], r["snapshot"], r["commit"], r.get("made_from"))
        for r in reply["runs"]
    ]
    text = str(reply.get("diff") or "").encode("utf-8", "surrogateescape")
    if reply.get("diff_cut"):
        text += b"\n[rv: the diff was cut at 64 MB]\n"
    return runs, text


def check_new_folder(dest: Path) -> None:
    """DIR must be new (or an empty folder) and makeable: a checkout never writes over anything. Before
    any call."""
    hint = f"name a folder that does not exist yet, e.g. {dest.name}-run"
    if dest.is_symlink() and not dest.exists():
        raise UsageError(
            f"{dest} is a symlink to {os.readlink(dest)}, which does not exist: rv checkout writes a run's "
            "files into a new folder, never through a link",
            hint=hint,
        )
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(
            f"{dest} exists and is not an empty folder: rv checkout writes a run's files into a new one",
            hint=hint,
        )
    # The nearest folder above that exists must be one, and writable: mkdir would fail half-way.
    for up in [dest, *dest.parents]:
        if not os.path.lexists(up):
            continue
        if not up.is_dir():
            what = "a symlink to nothing" if up.is_symlink() and not up.exists() else "a file, not a folder"
            raise UsageError(f"{up} is {what}: rv checkout cannot make {dest} under it", hint=hint)
        if up != dest and not os.access(up, os.W_OK | os.X_OK):
            raise UsageError(f"{up} is not writable by you: rv checkout cannot make {dest} in it", hint=hint)
        break


def made_folder(dest: Path) -> Path | None:
    """Make ``dest`` (checked by :func:`check_new_folder`); the topmost folder this made, to remove
    when the checkout fails (None: ``dest`` was there already, an empty folder)."""
    top = None
    for up in [dest, *dest.parents]:
        if os.path.lexists(up):
            break
        top = up
    dest.mkdir(parents=True, exist_ok=True)
    return top


def unmake_folder(dest: Path, top: Path | None) -> None:
    """A failed checkout leaves nothing: the folders it made go, an empty folder it was given is
    emptied again."""
    if top is not None:
        shutil.rmtree(top, ignore_errors=True)
        return
    for child in dest.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def checkout_here(repo: LocalStore, commit: str, dest: Path) -> int:
    """The commit's files into ``dest`` (made) as a job checks them out (read-tree + checkout-index:
    exec bits, symlinks and odd names kept, no conversion). Returns the number of files."""
    with temp_dir("checkout") as tmp:
        env = repo.env(GIT_INDEX_FILE=os.path.join(tmp, "index"))
        repo.run(["read-tree", commit], env=env)
        repo.run(["-c", "core.symlinks=true", f"--work-tree={dest}", "checkout-index", "-a", "-u"], env=env)
        listed = repo.run(["ls-files", "-z"], env=env).stdout
    return listed.count(b"\0")


def _store_git(root: str, args: str) -> str:
    """A shell line running git on the cluster's store, with none of the user's git configuration."""
    store = shlex.quote(f"{root.rstrip('/')}/store.git")
    return (
        f"env GIT_DIR={store} GIT_CONFIG_NOSYSTEM=1 HOME={store} XDG_CONFIG_HOME={store} LC_ALL=C git {args}"
    )


def _writer(pipe: IO[bytes]) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        pipe.write(data)

    return write


# git's words for objects a store lacks (a purge took them, or a pack is damaged).
_LOST = ("not a tree object", "bad object", "unable to read", "missing blob", "missing tree", "is corrupt")


def checkout_from_cluster(transport: Transport, root: str, code: RunCode, dest: Path) -> int:
    """The run's files streamed from the cluster's store (``git archive``) into ``dest`` (made), as
    git checks files out: dated now, modes 0666/0777 less this user's umask (tar.umask=0 in the
    archive, --no-same-permissions here; the archive's own date is the commit's, 1970)."""
    tar = subprocess.Popen(
        ["tar", "-x", "-m", "--no-same-permissions", "--no-same-owner", "-f", "-", "-C", str(dest)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert tar.stdin is not None
    remote_err: list[bytes] = []
    exit_code = transport.stream(
        _store_git(root, f"-c tar.umask=0 archive --format=tar {shlex.quote(code.commit)}"),
        on_stdout=_writer(tar.stdin), on_stderr=remote_err.append, timeout=3600,
    )  # fmt: skip
    tar.stdin.close()
    err = tar.stderr.read().decode("utf-8", "replace") if tar.stderr else ""
    if tar.wait() != 0 or exit_code != 0:
        said = (b"".join(remote_err).decode("utf-8", "replace") or err).strip()
        if any(word in said for word in _LOST):
            raise NotFound(
                f"the cluster's store no longer holds all of run {code.name}'s files (snapshot "
                f"{code.snapshot[:12]}; a purge of the filesystem?): git says "
                f"{said.splitlines()[-1][:200]!r}; nothing was written",
                hint="the store gets them back when a run of the same files is sent (rv run from the code it "
                "ran)",
            )
        raise RemoteError(
            f"could not check out run {code.name}'s files from the cluster's store: "
            f"{said[-300:] or 'no message'}; nothing was written"
        )
    return sum(len(files) for _d, _s, files in os.walk(dest))


def fetch_from_cluster(transport: Transport, root: str, repo: LocalStore, code: RunCode) -> None:
    """The commit and everything it reaches, as one pack from the cluster's store into ``repo``."""
    index = subprocess.Popen(
        ["git", "index-pack", "--stdin", "--fix-thin"],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, **repo.env()}, cwd=repo.path,
    )  # fmt: skip
    assert index.stdin is not None
    line = f"printf '%s\\n' {shlex.quote(code.commit)} | " + _store_git(
        root, "pack-objects --revs --stdout -q"
    )
    remote_err: list[bytes] = []
    exit_code = transport.stream(
        line,
        on_stdout=_writer(index.stdin),
        on_stderr=remote_err.append,
        timeout=3600,
    )
    index.stdin.close()
    err = index.stderr.read().decode("utf-8", "replace") if index.stderr else ""
    if index.wait() != 0 or exit_code != 0:
        said = b"".join(remote_err).decode("utf-8", "replace") or err
        raise RemoteError(f"could not fetch run {code.name}'s files: {said.strip()[-300:] or 'no message'}")
    repo.remember(code.snapshot, code.commit)


def check_branch(here: Path, git: Git, branch: str, ref: str) -> Path:
    """``--branch``: the repository's top, once the name is valid and free and nothing is
    uncommitted. Before any call to the cluster."""
    top = find_repo_top(here, git)
    if top is None:
        raise UsageError("--branch makes a branch of the repository you are in, and this is not one",
                         hint=f"cd into the project's repository, or rv checkout {ref} DIR")  # fmt: skip
    if git.run(["check-ref-format", "--branch", branch], top, ok_codes=(0, 1, 128)).returncode != 0:
        raise UsageError(f"--branch {branch!r} is not a valid branch name", hint="e.g. --branch run-lr3e-4")
    if git.run(["rev-parse", "-q", "--verify", f"refs/heads/{branch}"], top, ok_codes=(0, 1)).returncode == 0:
        raise UsageError(f"branch {branch} exists already: rv checkout never moves a branch",
                         hint="pick another --branch name")  # fmt: skip
    if git.run(["var", "GIT_COMMITTER_IDENT"], top, ok_codes=(0, 1, 128)).returncode != 0:
        raise UsageError(
            "--branch makes a commit, and git does not know who you are here (user.name, user.email)",
            hint='git config --global user.name "Your Name"; git config --global user.email you@example.org',
        )
    dirty = git.out(["status", "--porcelain", "--untracked-files=no"], top)
    if dirty.strip():
        raise UsageError(
            "the work tree has uncommitted changes, and switching to the run's branch would take them along "
            "or stop half-way: nothing was changed",
            hint=f"commit or stash them first (git stash), or write the files apart: rv checkout {ref} DIR",
        )
    return top


def make_branch(top: Path, git: Git, repo: LocalStore, code: RunCode, branch: str) -> str:
    """A commit of the run's files on the new branch ``branch`` of the repository at ``top`` (checked
    by :func:`check_branch`), switched to."""
    # The objects rv's repository holds that the user's does not (files that were never committed).
    git.run(["fetch", "-q", "--no-tags", str(repo.path), f"refs/rv/snapshots/{code.snapshot}"], top)
    tree = git.out(["rev-parse", f"{code.commit}^{{tree}}"], top).decode().strip()
    parent = code.made_from
    has_parent = (
        bool(parent)
        and git.run(["cat-file", "-e", f"{parent}^{{commit}}"], top, ok_codes=(0, 1, 128)).returncode == 0
    )
    message = f"rv: the files run {code.name} ran (snapshot {code.snapshot})\n"
    made = (
        git.out(
            ["commit-tree", tree, *(["-p", str(parent)] if has_parent else []), "-F", "-"],
            top,
            input=message.encode(),
        )
        .decode()
        .strip()
    )
    git.run(["branch", branch, made], top)
    switched = git.run(["checkout", "-q", branch], top, ok_codes=(0, 1, 128))
    if switched.returncode != 0:
        # git switches all or nothing: with the branch gone again, the repository is as it was.
        git.run(["branch", "-D", branch], top, ok_codes=(0, 1, 128))
        said = " ".join(switched.stderr.decode("utf-8", "replace").split())
        raise UsageError(
            f"git would not switch to the run's files: {said[-400:]}; nothing was changed (no branch "
            f"{branch})",
            hint="move the files git names aside (or commit them), then run the command again; or write the "
            f"run's files apart: rv checkout {code.ref} DIR",
        )
    return made


def sweep_message(ref: str, points: int) -> str:
    """What ``rv diff``/``rv checkout`` say when given a sweep's name where they take a run."""
    return (
        f"{ref} is a sweep of {points} point(s), and rv diff and rv checkout take runs: name points of it, "
        f"e.g. {ref}/0 and {ref}/1 (rv sweep results {ref} lists them)"
    )


def refuse_sweeps(refs: Sequence[str], records: Sequence[RunRecord | None], store: Any, profile: str) -> None:
    """A ref this machine knows as a sweep's name (points ``REF/<i>`` of its records), before any call."""
    from rv.names import split_point_name

    for ref, record in zip(refs, records, strict=True):
        if record is not None:
            continue
        points = [r for r in store.all(profile) if (split_point_name(r.name) or ("", 0))[0] == ref]
        if points:
            raise UsageError(sweep_message(ref, len(points)), hint=f"rv sweep results {ref}")


def resolve_records(store: Any, profile: str, refs: Sequence[str]) -> list[RunRecord | None]:
    """This machine's records of the runs, where it has them (it submitted them)."""
    out = []
    for ref in refs:
        try:
            out.append(store.resolve(ref, profile))
        except NotFound:
            out.append(None)
    return out
