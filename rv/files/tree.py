"""A listed tree: its entries (path, git mode, blob id, size), its manifest, what git said of its repo."""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rv.agent import manifest

MODE_FILE, MODE_EXEC, MODE_LINK, MODE_GITLINK = 0o100644, 0o100755, 0o120000, 0o160000
READ_CHUNK = 1 << 20
LARGE_FLOOR = 1_000_000  # files this big are remembered, so the size check needs no parse


# --------------------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True, slots=True)
class Entry:
    """One file of a tree: ``mode`` is git's (100644, 100755 or 120000), ``oid`` its blob id."""

    path: str
    mode: int
    oid: str
    size: int
    mtime_ns: int = 0  # local only (push's quick check); not part of the manifest

    def row(self) -> list[Any]:
        return [self.path, self.mode, self.oid, self.size]

    @property
    def is_link(self) -> bool:
        return self.mode == MODE_LINK


def blob_id(data: bytes) -> str:
    h = manifest.blob_hasher(len(data))
    h.update(data)
    return str(h.hexdigest())


def snapshot_id(entries: Iterable[Entry]) -> str:
    """Derived from the manifest alone, so identical trees are one snapshot."""
    return str(manifest.manifest_id([e.row() for e in entries]))


def sort_entries(entries: Iterable[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: manifest.enc(e.path))


def hash_path(full: str | Path) -> tuple[int, str, int, int] | None:
    """(mode, oid, size, mtime_ns) of a file or symlink as git would store it; None if absent/special."""
    try:
        st = os.lstat(full)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.fsencode(os.readlink(full))
        return MODE_LINK, blob_id(target), len(target), st.st_mtime_ns
    if not stat.S_ISREG(st.st_mode):
        return None
    mode = MODE_EXEC if st.st_mode & stat.S_IXUSR else MODE_FILE
    h = manifest.blob_hasher(st.st_size)
    left = st.st_size
    with open(full, "rb") as fh:
        while left > 0:
            data = fh.read(min(READ_CHUNK, left))
            if not data:
                # Shrank since the stat: hash what is there now, with its own size.
                return hash_path(full)
            h.update(data)
            left -= len(data)
    return mode, h.hexdigest(), st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class RepoInfo:
    top: Path
    git_dir: Path
    commit: str | None
    branch: str | None
    remote_url: str | None
    dirty: bool
    untracked: tuple[str, ...]
    # Paths of the top repository whose content may differ from HEAD's (staged, or changed in the
    # work tree, and every submodule): what the provenance diff is limited to. None: not known.
    changed: tuple[str, ...] | None = None
    submodules: tuple[str, ...] = ()  # the top repository's submodules (their diff is never kept)


class ManifestPaths(Collection[str]):
    """The paths of a manifest: membership by binary search, iteration by one parse of the text."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def __contains__(self, path: object) -> bool:
        return isinstance(path, str) and manifest.row_at(self.text, path) is not None

    def __iter__(self) -> Iterator[str]:
        return (row[0] for row in manifest.manifest_rows(self.text))

    def __len__(self) -> int:
        return self.text.count(b"\n")

    def under(self, prefix: str) -> Iterator[str]:
        """The paths that start with ``prefix``, in manifest order."""
        key = manifest.enc(prefix)
        start = manifest.find_line(self.text, key)[0]
        while start < len(self.text):
            end = self.text.index(b"\n", start) + 1
            path = manifest.parse_line(self.text[start:end])[0]
            if not manifest.enc(path).startswith(key):
                return
            yield path
            start = end


@dataclass(frozen=True)
class LocalTree:
    """The files a snapshot or push would carry, relative to ``root``, as a manifest text.

    ``entries`` parses the whole manifest (on first use): the hot paths (a resubmit with nothing or
    little changed) never need it.
    """

    root: Path
    manifest: bytes  # rv.agent.manifest's text: one line per file, sorted by path
    files: int
    total_size: int
    large: tuple[tuple[str, int], ...] = ()  # every file of LARGE_FLOOR bytes or more: (path, size)
    ignored: tuple[tuple[str, int], ...] = ()  # left out by .rvignore: (path, size; -1 for a folder)
    warnings: tuple[str, ...] = ()
    repo: RepoInfo | None = None
    secrets: tuple[str, ...] = ()  # untracked files left out because they look like secrets
    mtimes: dict[str, int] | None = field(default=None, compare=False, repr=False)
    # (id of the manifest this machine listed before, {path: row or None} since then): lets an
    # upload send a delta against it without comparing the two manifests.
    previous: tuple[str, dict[str, list[Any] | None]] | None = field(default=None, compare=False, repr=False)
    # The paths whose ids were hashed here rather than taken from git's index (None: every path):
    # only their blobs may be missing from the repository's object folders, listed in object_dirs.
    unindexed: frozenset[str] | None = field(default=None, compare=False, repr=False)
    object_dirs: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, root: Path, entries: Iterable[Entry], **kw: Any) -> LocalTree:
        entries = list(entries)
        text = manifest.manifest_text([e.row() for e in entries])
        mtimes = {e.path: e.mtime_ns for e in entries} if any(e.mtime_ns for e in entries) else None
        large = tuple((e.path, e.size) for e in entries if e.size >= LARGE_FLOOR)
        return cls(root, text, len(entries), sum(e.size for e in entries), large, mtimes=mtimes, **kw)

    @functools.cached_property
    def id(self) -> str:
        return str(manifest.text_id(self.manifest))

    @functools.cached_property
    def entries(self) -> tuple[Entry, ...]:
        mtimes = self.mtimes or {}
        return tuple(
            Entry(p, m, o, s, mtimes.get(p, 0)) for p, m, o, s in manifest.manifest_rows(self.manifest)
        )

    @property
    def paths(self) -> ManifestPaths:
        return ManifestPaths(self.manifest)

    def subtree(self, rel: str) -> LocalTree:
        """The part under ``rel`` (a folder inside root), with paths relative to it."""
        if rel in ("", "."):
            return self
        prefix = rel.rstrip("/") + "/"
        return LocalTree.of(
            self.root / rel,
            [replace(e, path=e.path[len(prefix) :]) for e in self.entries if e.path.startswith(prefix)],
            ignored=tuple((p[len(prefix) :], s) for p, s in self.ignored if p.startswith(prefix)),
            warnings=self.warnings,
            repo=self.repo,
            secrets=tuple(p[len(prefix) :] for p in self.secrets if p.startswith(prefix)),
        )
