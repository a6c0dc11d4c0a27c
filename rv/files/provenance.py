"""Where a snapshot came from: the project key, branch, commit, remote (credentials stripped), and
the diff of a dirty tree, made file by file and kept so a resubmit diffs only what changed since."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv import __version__
from rv.agent import manifest

if TYPE_CHECKING:
    from rv.files.treecache import TreeCache

from rv.files.listing import Git, LocalTree, RepoInfo
from rv.files.tmpdirs import temp_dir

DIFF_LIMIT = 1 << 20  # provenance keeps at most 1 MiB of a dirty tree's diff


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "project"


def project_key(tree: LocalTree, git: Git | None = None, cache_dir: Path | None = None) -> str:
    """``<folder>-<first 10 hex of the root commit>``: unique to the repo, not to its folder name.

    The root commit is the one reached by first parents from HEAD, so merging another history in
    does not change it. Without a commit (or a repo): a hash of the absolute path instead.
    """
    git = git or Git()
    name = _slug(tree.root.name)
    if tree.repo is not None and tree.repo.commit:
        root_commit = _root_commit(tree.repo, git, cache_dir)
        if root_commit:
            return f"{name}-{root_commit[:10]}"
    return f"{name}-{hashlib.sha256(os.fsencode(tree.root)).hexdigest()[:10]}"


def _root_commit(repo: RepoInfo, git: Git, cache_dir: Path | None) -> str | None:
    cache = cache_dir / "root-commits.json" if cache_dir else None
    known: dict[str, str] = {}
    if cache and cache.exists():
        with contextlib.suppress(ValueError, OSError):
            known = json.loads(cache.read_text())
        hit = known.get(str(repo.git_dir))
        # Walking a long history is slow; a cached answer is checked with one cheap lookup.
        if (
            hit
            and git.run(["cat-file", "-e", hit + "^{commit}"], repo.top, ok_codes=(0, 1, 128)).returncode == 0
        ):
            return hit
    out = git.out(["rev-list", "--first-parent", "--max-parents=0", "HEAD"], repo.top).split()
    if not out:
        return None
    root = out[-1].decode()
    if cache:
        known[str(repo.git_dir)] = root
        from rv.config import write_private

        with contextlib.suppress(OSError):  # a cache: failing to keep it only costs time
            write_private(cache, json.dumps(known).encode())
    return root


def provenance(
    tree: LocalTree,
    project: str,
    subdir: str,
    git: Git | None = None,
    *,
    with_diff: bool = True,
    cache: TreeCache | None = None,
) -> dict[str, Any]:
    """Where a snapshot came from: stored beside it on the cluster and in the job record.

    ``with_diff=False`` leaves the dirty tree's diff out (``diff`` is then None): it is only needed
    when the snapshot is new, so a resubmit does not pay for ``git diff``. With a ``cache``, the
    diff's part for a file is made again only when the file or HEAD changed (see diff_head).
    """
    import getpass
    import socket

    git = git or Git()
    repo = tree.repo
    prov: dict[str, Any] = {
        "project": project,
        "path": str(tree.root),
        "subdir": subdir,
        "host": socket.gethostname(),
        "user": getpass.getuser(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rv_version": __version__,
        "repo": None,
        "remote_url": None,
        "branch": None,
        "commit": None,
        "dirty": None,
        "diff": "",
        "diff_truncated": False,
        "untracked": [],
    }
    if repo is None:
        return prov
    prov.update(
        repo=str(repo.top),
        remote_url=repo.remote_url,
        branch=repo.branch,
        commit=repo.commit,
        dirty=repo.dirty,
    )
    prov["untracked"] = list(repo.untracked[:1000])
    if not with_diff:
        prov["diff"] = None
    elif repo.dirty and repo.commit:
        diff = diff_head(tree, git, cache)
        prov["diff_truncated"] = len(diff) > DIFF_LIMIT
        prov["diff"] = diff[:DIFF_LIMIT].decode("utf-8", "replace")
    return prov


# `git diff HEAD` for the provenance, without rename detection (so that each file's part depends on
# that file alone) and with the prefixes fixed (a user's diff.noprefix must not change the format).
_DIFF = [
    "-c", "core.quotePath=true", "diff", "HEAD", "--no-color", "--no-ext-diff", "--no-textconv",
    "--submodule=short", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/",
]  # fmt: skip
_DIFF_PATHS_MAX = 20_000  # more changed paths than this: one diff of everything, no pathspec list
_DIFF_BATCH = 1_000  # paths per git call, far below any system's limit on a command line
_DIFF_SPEC_MAX = 256  # more files to diff by pathspec than this: one `git diff HEAD` of everything
# Through an index of their own (see _diff_by_index) when git would match more index entries
# against pathspecs than this (files to diff × files in the tree): three git calls instead of one.
_DIFF_INDEX_MATCHES = 1_000_000


def diff_head(tree: LocalTree, git: Git, cache: TreeCache | None = None) -> bytes:
    """What ``git diff HEAD`` shows for the tree's repository, made from cached parts where it can.

    The part of a file depends only on HEAD's commit and the file's content and mode (renames are
    not detected), so with a cache only files changed since the last diff are diffed again: a resubmit
    after one edit diffs one file, however many others are dirty.
    """
    repo = tree.repo
    assert repo is not None and repo.commit is not None
    changed = repo.changed
    if changed == ():
        return b""
    if changed is None or len(changed) > _DIFF_PATHS_MAX:
        return git.out(_DIFF, repo.top)
    if cache is None:
        return _diff_of(git, repo.top, changed)
    kept = cache.diffs(repo.top)
    files = kept["files"] if kept.get("head") == repo.commit else {}
    subs = set(repo.submodules)
    paths = [p for p in changed if p not in subs]
    previous = tree.previous
    if files and previous is not None and kept.get("sid") == previous[0]:
        # The parts were made for the last listing, whose changes since are at hand: only those
        # rows can differ from their keys. No parse of the manifest, however many files are dirty
        # (0.15 s at 50,000 files, every resubmit once more than 64 are).
        since = previous[1]
        keys = {
            p: since[p] if p in since else files[p][0] if p in files else manifest.row_at(tree.manifest, p)
            for p in paths
        }
    elif len(paths) > 64:  # one parse of the manifest (C speed) beats a search per path
        rows = {r[0]: r for r in manifest.manifest_rows(tree.manifest)}
        keys = {p: rows.get(p) for p in paths}
    else:
        keys = {p: manifest.row_at(tree.manifest, p) for p in paths}
    todo = [p for p in changed if p in subs or p not in files or files[p][0] != keys[p]]
    fresh: dict[str, bytes] | None = {}
    if len(todo) * tree.files > _DIFF_INDEX_MATCHES:
        fresh, todo_left = _diff_by_index(git, repo.top, [p for p in todo if p not in subs])
        todo_left += [p for p in todo if p in subs]
    else:
        todo_left = todo
    if fresh is not None and len(todo_left) > _DIFF_SPEC_MAX:
        # git matches every index entry against every pathspec: with 500 paths of a 50,000-file
        # repo that took 1.5-1.9 s, the whole `git diff HEAD` 0.8-0.95 s (its parts are split below).
        fresh = _diff_parts(git.out(_DIFF, repo.top))
    elif fresh is not None and todo_left:
        more = _diff_parts(_diff_of(git, repo.top, todo_left))
        fresh = None if more is None else {**fresh, **more}
    if fresh is None:  # a header this code cannot read: the plain diff, nothing kept
        return _diff_of(git, repo.top, changed)
    parts = {p: fresh.get(p, b"") if p in todo else files[p][1] for p in changed}
    cache.put_diffs(
        repo.top, {"head": repo.commit, "sid": tree.id, "files": {p: [keys[p], parts[p]] for p in keys}}
    )
    return b"".join(parts[p] for p in sorted(parts, key=manifest.enc))


def _diff_by_index(git: Git, top: Path, paths: Sequence[str]) -> tuple[dict[str, bytes] | None, list[str]]:
    """The parts of ``git diff HEAD`` for ``paths``, by a diff of the work tree against an index of
    their own holding only HEAD's entries for them: git then looks at those files alone.

    A pathspec list costs git a match of every index entry against every path (1.5-1.9 s for 500
    paths of a 50,000-file repo) and the whole `git diff HEAD` stats and diffs every dirty file
    (0.73 s with 1,500 dirty); this took 0.15 s for 500 paths, with the same bytes for each file.
    Returns (parts, the paths HEAD has no file for: new in the index, or a submodule); the parts
    are None when a header cannot be read.
    """
    want = {manifest.enc(p) for p in paths}  # compared as bytes: no decoding of every HEAD path
    listing = git.out(["ls-tree", "-r", "-z", "--full-tree", "HEAD"], top)
    records, found = [], set()
    for record in listing.split(b"\0"):
        meta, _, raw = record.partition(b"\t")
        if raw in want and not meta.startswith(b"160000"):  # a submodule's entry: by pathspec
            records.append(record)
            found.add(raw)
    rest = [p for p in paths if manifest.enc(p) not in found]
    if not records:
        return {}, rest
    with temp_dir("diff") as tmp:
        # Private to this run (0700): the index names the user's files. No split or sparse index
        # for it, which would write shared files into the repository's own .git.
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}
        config = ["-c", "core.splitIndex=false", "-c", "index.sparse=false"]
        entries = b"\0".join(records) + b"\0"
        git.out([*config, "update-index", "-z", "--index-info"], top, input=entries, env=env)
        out = git.out([*config, *(a for a in _DIFF if a != "HEAD")], top, env=env)
    return _diff_parts(out), rest


def _diff_of(git: Git, top: Path, paths: Sequence[str]) -> bytes:
    """``git diff HEAD -- PATHS``, in batches of paths, in git's order (by the paths' bytes)."""
    ordered = sorted(paths, key=manifest.enc)
    literal = {"GIT_LITERAL_PATHSPECS": "1"}
    return b"".join(
        git.out([*_DIFF, "--", *ordered[i : i + _DIFF_BATCH]], top, env=literal)
        for i in range(0, len(ordered), _DIFF_BATCH)
    )


_C_ESCAPES = {ord("a"): 7, ord("b"): 8, ord("t"): 9, ord("n"): 10, ord("v"): 11, ord("f"): 12, ord("r"): 13,
              ord('"'): 34, ord("\\"): 92}  # fmt: skip


def _c_unquote(data: bytes) -> bytes | None:
    """The first C-quoted string (as git writes unusual paths) of ``data``, which starts with '"'."""
    out, i = bytearray(), 1
    while i < len(data):
        c = data[i]
        if c == 34:
            return bytes(out)
        if c == 92 and i + 1 < len(data):
            n = data[i + 1]
            if n in _C_ESCAPES:
                out.append(_C_ESCAPES[n])
                i += 2
                continue
            if 48 <= n <= 55:
                out.append(int(data[i + 1 : i + 4], 8))
                i += 4
                continue
            return None
        out.append(c)
        i += 1
    return None


def _diff_parts(out: bytes) -> dict[str, bytes] | None:
    """``git diff --no-renames`` output split by file; None if a header cannot be read."""
    starts = [m.start() for m in re.finditer(rb"^diff --git ", out, re.M)]
    parts = {}
    for i, start in enumerate(starts):
        chunk = out[start : starts[i + 1] if i + 1 < len(starts) else len(out)]
        header = chunk.split(b"\n", 1)[0][len(b"diff --git ") :]
        if header.startswith(b'"'):
            a = _c_unquote(header)
            if a is None or not a.startswith(b"a/"):
                return None
            path = a[2:]
        else:
            # "a/<path> b/<path>", the same path twice (no renames)
            half = (len(header) - 5) // 2
            path = header[2 : 2 + half]
            if header[:2] != b"a/" or header[2 + half :] != b" b/" + path:
                return None
        parts[manifest.dec(path)] = chunk
    return parts
