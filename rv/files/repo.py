"""The repository's facts recorded with each run: its top folder, HEAD, branch, dirty state and remote.

Read with GitPython, which reads them from the repository's own files (HEAD, refs, config) instead of
parsing git's output line by line. It is imported only when a run is sent, on a thread of its own
while the cluster answers the run's check (:func:`facts_soon`): importing it costs tens of
milliseconds and runs ``git version``, and `rv ps`, `rv run --dry-run` and every other command that
sends no run never load it.

The dirty state is the listing's (rv.files.listing), not asked again: the listing has decided it
already, from its caches, for the very files the snapshot holds, whereas GitPython's ``is_dirty``
would run ``git diff`` twice and ``git status`` over the whole tree. The listing itself stays on
git's plumbing commands, run side by side, for speed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.files.listing import Soon, redact_url

if TYPE_CHECKING:
    from git import Repo


@dataclass(frozen=True)
class RepoFacts:
    root: str  # the work tree's top folder on this machine
    head: str | None  # HEAD's commit; None before the first commit
    branch: str | None  # None on a detached HEAD
    dirty: bool  # anything the snapshot holds differs from HEAD (the listing's answer)
    remote: str | None  # origin's URL without the credentials it may carry; None without an origin

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class FactsUnreadable(Exception):
    """GitPython could not read a repository that git itself listed (a format it does not know)."""


def read_facts(top: Path, *, dirty: bool) -> RepoFacts:
    """The facts of the repository whose work tree's top is ``top``; :class:`FactsUnreadable` when
    GitPython cannot read them."""
    import configparser

    import git

    try:
        return _read(git.Repo(top), top, dirty)
    except (git.exc.GitError, git.exc.ODBError, configparser.Error, ValueError, OSError) as exc:
        raise FactsUnreadable(f"{type(exc).__name__}: {exc}") from exc


def _read(repo: Repo, top: Path, dirty: bool) -> RepoFacts:
    from git.refs.symbolic import SymbolicReference

    try:
        try:
            # HEAD's commit id from the refs alone: looking the commit object up would start a
            # `git cat-file` (the listing has checked the commit already).
            head: str | None = SymbolicReference.dereference_recursive(repo, "HEAD")
        except ValueError:  # HEAD names a branch with no commit yet
            head = None
        branch = None if repo.head.is_detached else repo.active_branch.name
        with repo.config_reader() as config:
            url = config.get_value('remote "origin"', "url", "")
        return RepoFacts(
            root=str(repo.working_tree_dir or top),
            head=head,
            branch=branch,
            dirty=dirty,
            remote=redact_url(str(url)) or None,
        )
    finally:
        repo.close()  # ends any git process GitPython kept for this repository


def facts_soon(top: Path | None, *, dirty: bool) -> Soon:
    """:func:`read_facts` on a thread of its own (``result()``: the facts, or None outside a repository)."""
    if top is None:
        return Soon(lambda: None)
    return Soon(read_facts, top, dirty=dirty)
