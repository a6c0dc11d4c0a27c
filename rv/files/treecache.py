"""What this machine remembers between listings and uploads, so a resubmit costs what changed.

Several things, all under the cache folder (``rv.config.cache_dir()``) and all safe to delete (the
next command is then as slow as a first one, never wrong):

* ``trees/<repo>``: the last listing of each repository (see rv.files.listing.scan_tree): the index
  signature it was made from, the files it hashed with their stat data, and the id of its manifest.
* ``texts/<id>``: manifests by snapshot id (rv.agent.manifest's text format).
* ``git-stores/<store>``: per remote store and project, the snapshots known to be there and their
  commits (what a thin pack may leave out).
* ``links/<store>``: the rate last measured to each remote store's cluster (rv.files.link), by
  which an upload's packs are made.
* ``git/<repo>``: rv's own git repository for each work tree (rv.files.packs): its index, trees,
  commits and the blobs of files git's index does not hold.
* ``diffs/<repo>``: the last provenance diff of each repository, file by file, with what each file's
  part was made from (HEAD's commit, the file's content and mode): a part is made again only when
  one of those changed.

Files are written whole and renamed into place, readable by the user only. A file that cannot be
read (damaged, written by another version) counts as absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import marshal
import os
import time
from pathlib import Path
from typing import Any

from rv.config import write_private

FORMAT = 1
# A hashed file's cached id is trusted only when its ctime and mtime are older than the moment its
# hashing began by this much: a write in the same clock tick as the hash (racy, as git calls it) can
# leave size, mtime, ctime and inode as they were, and must not be missed. Two seconds covers
# filesystems with coarse timestamps (FAT: 2 s) and a small skew between clocks.
RACY_NS = 2_000_000_000
KEEP_TEXTS = 12
KEEP_IDS = 8

StatKey = tuple[int, int, int, int]  # size, mtime_ns, ctime_ns, inode
Hashed = tuple[int, str, int] | None  # (mode, blob id, size) or None: absent, or not a file or link


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def trusted(key: StatKey | list[int], stamp: int, now_key: StatKey) -> bool:
    """May a cached id, taken with ``key`` at ``stamp``, stand for a file whose stat is ``now_key``?"""
    return tuple(key) == now_key and max(key[1], key[2]) < stamp - RACY_NS


def _name(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:20]


class TreeCache:
    """The listing cache: in memory always, on disk under ``directory`` when one is given.

    `rv sync watch` keeps one in memory for its whole run; commands use the folder.
    """

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._states: dict[str, dict[str, Any]] = {}
        self._texts: dict[str, bytes] = {}

    # -- listings ------------------------------------------------------------------------------------
    def state(self, top: Path) -> dict[str, Any] | None:
        key = str(top)
        if key in self._states:
            return self._states[key]
        if self.directory is None:
            return None
        try:
            state = marshal.loads((self.directory / "trees" / _name(key)).read_bytes())
        except (OSError, ValueError, EOFError, TypeError):
            return None
        if not isinstance(state, dict) or state.get("format") != FORMAT or state.get("top") != key:
            return None
        self._states[key] = state
        return state

    def put_state(self, top: Path, state: dict[str, Any]) -> None:
        key = str(top)
        state = dict(state, format=FORMAT, top=key)
        self._states[key] = state
        if self.directory is not None:
            with contextlib.suppress(OSError):  # a cache: failing to keep it only costs time
                write_private(self.directory / "trees" / _name(key), marshal.dumps(state))

    # -- provenance diffs ----------------------------------------------------------------------------
    def diffs(self, top: Path) -> dict[str, Any]:
        """The last provenance diff of ``top``, by file: {"head": commit, "sid": the manifest's id,
        "files": {path: [its manifest row, its part of the diff]}}."""
        key = "diff\0" + str(top)
        if key in self._states:
            return self._states[key]
        data: Any = None
        kept: dict[str, Any]
        if self.directory is not None:
            with contextlib.suppress(OSError, ValueError, EOFError, TypeError):
                data = marshal.loads((self.directory / "diffs" / _name(str(top))).read_bytes())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            data = {"format": FORMAT, "head": None, "files": {}}
        kept = data
        self._states[key] = kept
        return kept

    def put_diffs(self, top: Path, data: dict[str, Any]) -> None:
        data = dict(data, format=FORMAT)
        self._states["diff\0" + str(top)] = data
        if self.directory is not None:
            with contextlib.suppress(OSError):
                write_private(self.directory / "diffs" / _name(str(top)), marshal.dumps(data))

    # -- manifests -----------------------------------------------------------------------------------
    def text(self, sid: str) -> bytes | None:
        if sid in self._texts:
            return self._texts[sid]
        if self.directory is None:
            return None
        path = self.directory / "texts" / sid
        try:
            data = path.read_bytes()
        except OSError:
            return None
        from rv.agent.manifest import text_id

        if text_id(data) != sid:
            return None  # damaged: never build on it
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept by the pruning below
        self._texts[sid] = data
        return data

    def put_text(self, sid: str, text: bytes) -> None:
        self._texts[sid] = text
        if self.directory is None:
            return
        folder = self.directory / "texts"
        path = folder / sid
        with contextlib.suppress(OSError):
            if path.exists():
                os.utime(path)
                return
            write_private(path, text)
            names = sorted(folder.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            for old in names[KEEP_TEXTS:]:
                if not old.name.startswith("."):
                    old.unlink(missing_ok=True)


class StoreCache:
    """Per project, the snapshots known to be in one remote store, the newest first: their ids and
    the commits that hold them there (rv.files.packs: thin packs leave out what those reach).

    Kept apart from what an rv before the git store remembered (its stores held other things).
    """

    def __init__(self, directory: Path, store_key: str) -> None:
        self.directory = directory  # the cache folder: rv's repositories of snapshots are there too
        self.key = store_key
        self.path = directory / "git-stores" / _name(store_key)

    def _load(self) -> dict[str, list[list[str]]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _pairs(self, data: dict[str, Any], project: str) -> list[tuple[str, str]]:
        rows = data.get(project, [])
        if not isinstance(rows, list):
            return []
        ok = [r for r in rows if isinstance(r, list) and len(r) == 2]
        return [(r[0], r[1]) for r in ok if isinstance(r[0], str) and isinstance(r[1], str)]

    def known(self, project: str) -> list[str]:
        return [sid for sid, _commit in self._pairs(self._load(), project)]

    def commits(self, project: str) -> list[tuple[str, str]]:
        """``(snapshot id, commit)`` of each snapshot known to be there whose commit is known."""
        return [(sid, commit) for sid, commit in self._pairs(self._load(), project) if commit]

    def held(self, project: str, sid: str, files: int) -> tuple[str, str, int] | None:
        """``(sid, commit, files)`` when ``sid`` is known to be there with its commit: what the run's
        check asks the store to confirm (rv.job.submit.check)."""
        commit = dict(self.commits(project)).get(sid)
        return (sid, commit, files) if commit else None

    def add(self, project: str, sid: str, commit: str = "") -> None:
        data = self._load()
        pairs = [(sid, commit), *(p for p in self._pairs(data, project) if p[0] != sid)][:KEEP_IDS]
        rows = [list(p) for p in pairs]
        if data.get(project) == rows:
            return
        data[project] = rows
        with contextlib.suppress(OSError):
            write_private(self.path, json.dumps(data).encode())

    def forget(self, project: str, sid: str | None = None) -> None:
        """Forget one snapshot (or, without ``sid``, every one) of ``project``."""
        data = self._load()
        pairs = self._pairs(data, project)
        kept = [list(p) for p in pairs if sid is not None and p[0] != sid]
        if len(kept) != len(pairs):
            data[project] = kept
            with contextlib.suppress(OSError):
                write_private(self.path, json.dumps(data).encode())


def now_ns() -> int:
    return time.time_ns()
