"""The laptop's half of the git store: a snapshot as a git commit, and the packs that carry it.

rv keeps a bare repository of its own per work tree under the cache folder (``git/<name>``), whose
alternates are the object folders of the repository and its submodules and nested repositories: a
clean tracked file's blob is already there and is read in place; the blobs of edited and untracked
files (the listing hashed those) are written into rv's folder, never into the user's ``.git``.

The tree is built by git from an index of rv's own (``rv-index``), kept from one snapshot to the
next: a resubmit updates the rows that changed (``update-index --index-info``) and ``write-tree``
writes only the trees above them (git's cache-tree keeps the rest). The commit is a function of the
tree alone (fixed author, date and message, no parent), so the same files make the same commit here
and on the cluster, whoever sent them.

The blobs of edited and untracked files go into one pack of rv's folder, written here from the files
(rv.agent.packformat's writer, each blob checked against the listing's id), not a loose file each.

What to send is a list of objects: what the snapshot's commit reaches and the root trees of the
snapshots the cluster is known to hold do not (``rev-list --objects C --not T...``: only the part
that changed is walked). The commit and trees of an edit go as a thin pack of deltas against those
snapshots' trees (a folder of many files with one edited costs a few bytes; ``index-pack
--fix-thin`` on the cluster takes the bases from its store). Its blobs go whole where the link is
fast (a delta search here and its resolution on the cluster cost more than the bytes they save:
docs/measured.md) and as deltas too where it is slow; the zlib level likewise (rv.files.link
chooses both from the link's rate, measured by earlier uploads; RV_PACK_COMPRESSION set decides
alone). A large send goes as several packs, the commit and its trees first, each taken in whole on
the cluster as it arrives: a dropped link costs the pack in flight only, and the cluster can tell
what is still missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import struct
import subprocess
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.agent import manifest, packformat
from rv.errors import RemoteError
from rv.files import link
from rv.files.gitcmd import Git, GitError
from rv.files.tree import MODE_GITLINK, MODE_LINK, LocalTree

if TYPE_CHECKING:
    from rv.files.progress import ProgressCounter
    from rv.files.treecache import TreeCache

# The commit of a snapshot: no parent, a fixed author and date, the snapshot's id as its message.
_WHO = {"NAME": "rv", "EMAIL": "rv@localhost", "DATE": "@0 +0000"}
COMMIT_ENV = {f"GIT_{role}_{k}": v for role in ("AUTHOR", "COMMITTER") for k, v in _WHO.items()}

# pack-objects' zlib level and whether an edit's blobs go as deltas, as the user set them: None (unset)
# leaves both to rv.files.link's choice by the link's measured rate. 0 (stored) measured fastest end
# to end on the loopback cluster, where the link is not what limits (benchmarks/sync.py; README
# "Measured, Sync"): level 1 cost 4.3 s of CPU for 200 MB that level 0 packs in 1.1 s.
_LEVEL = os.environ.get("RV_PACK_COMPRESSION", "").strip()
PACK_COMPRESSION: int | None = int(_LEVEL) if _LEVEL else None

# A send larger than this goes as several packs (each one a whole pack on the cluster once it has
# arrived): what a dropped link costs, against a pack's overhead (a pack-objects and an index-pack,
# two files on the cluster).
CHUNK_BYTES = 32 << 20
CHUNK_OBJECTS = 8192

# Delta search (pack-objects' --window) only for sends this small: edits of files the cluster holds
# an older version of, where a delta is much smaller than the file. A first send has nothing to
# delta against that is worth the search's time.
DELTA_OBJECTS = 2000

# Objects named under this folder in pack-objects' input are never delta'd (info/attributes below):
# an edit's blobs go whole in the thin pack of its trees.
NO_DELTA = "rv-whole-blobs/"
ATTRIBUTES = f"/{NO_DELTA}** -delta\n".encode()

PACK_DATA, PACK_END, PACKS_END = b"D", b"N", b"E"
WHOLE_PACK, OBJECT, DEFLATED = b"W", b"O", b"Z"  # a pack of whole objects, written by rv.agent.packfile
# Over a slow link whole objects go deflated at level 1, each one that compresses: its first
# TRIAL_BYTES must shrink below TRIAL_RATIO (random or already compressed files go as they are).
TRIAL_BYTES, TRIAL_RATIO = 64 << 10, 0.9

# Blobs from this size go whole (rv.agent.packfile); smaller objects in packs of pack-objects. The
# agent's Python costs ~55 us an object; index-pack's two collision-detecting SHA-1 passes cost ~6.5
# ns a byte more than hashlib's: they break even near 8 KB. First syncs of benchmarks/sync.py's repos
# on the loopback cluster, medians of 3 and 2 (5,000 files, 200 MB / 50,000 files, 800 MB): all
# whole 2.43 / 9.49 s, from 8 KB 2.15 / 8.91 s, from 64 KB 2.38 / 9.20 s, all packs 3.59 / 8.90 s.
WHOLE_MIN_BYTES = 8 << 10
TYPE_CODES = {b"commit": 1, b"tree": 2, b"blob": 3}  # as a pack entry names them
FRAME_MAX = 1 << 20


def commit_message(sid: str) -> str:
    return f"rv snapshot {sid}\n"


def store_name(top: Path) -> str:
    return hashlib.sha256(str(top).encode("utf-8", "surrogateescape")).hexdigest()[:20]


@dataclass(frozen=True)
class Obj:
    """An object to send: its id, its path (pack-objects' delta heuristic; "" for the commit and
    the top tree) and, for a blob, its size."""

    oid: str
    path: str
    size: int = 0


@dataclass
class Sends:
    """What a call carries: packs of these objects, thin against ``bases`` (commits)."""

    structure: list[Obj] = field(default_factory=list)  # the commit and trees: the first pack
    blobs: list[Obj] = field(default_factory=list)
    bases: list[str] = field(default_factory=list)

    @property
    def thin(self) -> bool:
        """Sent against ``bases``: a thin pack (its deltas' bases left out) is among the packs."""
        return bool(self.bases)

    @property
    def blob_bytes(self) -> int:
        return sum(o.size for o in self.blobs)

    def __bool__(self) -> bool:
        return bool(self.structure or self.blobs)


class LocalStore:
    """rv's own bare repository for one work tree, under the cache folder."""

    def __init__(self, path: Path, git: Git, sources: Iterable[str] = ()) -> None:
        self.path = path
        self.git = git
        self._ensure(list(sources))

    @classmethod
    def existing(cls, path: Path, git: Git) -> LocalStore | None:
        """The repository at ``path`` as it is (its alternates untouched), or None when there is none."""
        if not (path / "objects").is_dir():
            return None
        store = cls.__new__(cls)
        store.path, store.git = path, git
        return store

    # -- the folder -------------------------------------------------------------------------------
    def _ensure(self, sources: list[str]) -> None:
        if not (self.path / "objects").is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = Path(tempfile.mkdtemp(prefix=".rv-git-", dir=self.path.parent))
            try:
                self.git.run(["init", "-q", "--bare", "--template=", str(tmp)], tmp)
                with contextlib.suppress(OSError):
                    os.rename(tmp, self.path)  # or another rv made it a moment ago
            finally:
                if tmp.exists():
                    subprocess.run(["rm", "-rf", str(tmp)], check=False)
        attributes = self.path / "info" / "attributes"
        if not attributes.is_file() or attributes.read_bytes() != ATTRIBUTES:
            attributes.parent.mkdir(parents=True, exist_ok=True)
            tmp_attr = attributes.with_name(f".attributes-{os.getpid()}")
            tmp_attr.write_bytes(ATTRIBUTES)
            os.replace(tmp_attr, attributes)
        alternates = self.path / "objects" / "info" / "alternates"
        want = "".join(f"{s}\n" for s in sources if os.path.isdir(s))
        try:
            have = alternates.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError:
            have = None
        if have != want:
            alternates.parent.mkdir(parents=True, exist_ok=True)
            tmp_alt = alternates.with_name(f".alternates-{os.getpid()}")
            tmp_alt.write_text(want, encoding="utf-8", errors="surrogateescape")
            os.replace(tmp_alt, alternates)

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "GIT_DIR": str(self.path),
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_INDEX_FILE": str(self.path / "rv-index"),
            **extra,
        }

    def run(
        self,
        args: Sequence[str],
        *,
        input: bytes | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        ok: tuple[int, ...] = (0,),
    ) -> subprocess.CompletedProcess[bytes]:
        args = ["-c", "core.protectNTFS=false", "-c", "core.protectHFS=false", *args]
        return self.git.run(args, cwd or self.path, input=input, env=env or self.env(), ok_codes=ok)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One build at a time per work tree (two rv commands of one repo share the index)."""
        fd = os.open(self.path / "rv-build.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- building the commit ----------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            data = json.loads((self.path / "rv-index.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def build(self, tree: LocalTree, texts: TreeCache | None = None) -> str:
        """The commit of snapshot ``tree``: its blobs written where git does not have them, its
        trees made from rv's index. Raises RemoteError when a file changed since it was listed."""
        sid = tree.id
        with self._locked():
            state = self._state()
            if state.get("sid") == sid and self.has(state.get("commit", "")):
                return str(state["commit"])
            changes = self._changes(tree, state, texts)
            # The index is about to change: until the new state is written, it stands for nothing.
            with contextlib.suppress(FileNotFoundError):
                (self.path / "rv-index.json").unlink()
            if changes is not None and (self.path / "rv-index").exists():
                rows = [r for r in changes.values() if r is not None]
                self.write_blobs(tree.root, rows)
                lines = [_index_line(r) if r is not None else _removal(p) for p, r in changes.items()]
            else:
                rows = manifest.manifest_rows(tree.manifest)
                fresh = tree.unindexed
                self.write_blobs(tree.root, [r for r in rows if fresh is None or r[0] in fresh])
                lines = [_index_line(r) for r in rows]
                with contextlib.suppress(FileNotFoundError):
                    (self.path / "rv-index").unlink()
            self.run(["update-index", "-z", "--replace", "--index-info"], input=b"".join(lines))
            tree_id = self.run(["write-tree", "--missing-ok"]).stdout.decode().strip()
            commit = (
                self.run(
                    ["commit-tree", "--no-gpg-sign", tree_id, "-m", commit_message(sid).rstrip("\n")],
                    env=self.env(**COMMIT_ENV),
                )
                .stdout.decode()
                .strip()
            )
            (self.path / "rv-index.json").write_text(
                json.dumps({"sid": sid, "tree": tree_id, "commit": commit})
            )
            return commit

    def _changes(
        self, tree: LocalTree, state: dict[str, Any], texts: TreeCache | None
    ) -> dict[str, list[Any] | None] | None:
        """What differs between the tree rv's index holds and ``tree``, when that is known cheaply."""
        have = state.get("sid")
        if not have:
            return None
        if tree.previous is not None and tree.previous[0] == have:
            return tree.previous[1]
        old = texts.text(have) if texts is not None else None
        if old is None:
            return None
        a, b = set(old.split(b"\n")), set(tree.manifest.split(b"\n"))
        changes: dict[str, list[Any] | None] = {}
        for line in a - b:
            if line:
                changes[manifest.parse_line(line)[0]] = None
        for line in b - a:
            if line:
                row = manifest.parse_line(line)
                changes[row[0]] = row
        return changes if len(changes) < max(64, tree.files // 2) else None

    def write_blobs(self, root: Path, rows: Sequence[Sequence[Any]]) -> None:
        """Write the blobs of ``rows`` (files under ``root``) into one pack of rv's folder; each must
        hash to its row's id (else the file changed since it was listed).

        One pack written here (rv.agent.packformat, stored: level 0) rather than a loose
        object per file (``hash-object -w``): 500 edited files took 0.03 s against 0.14 s. The
        packs pile up one per snapshot with edits; git's gc --auto (tidy) joins them past 50.
        """
        unique = list({str(r[2]): r for r in rows}.values())
        if not unique:
            return
        folder = self.path / "objects" / "pack"
        folder.mkdir(parents=True, exist_ok=True)
        writer = packformat.PackWriter(os.fsencode(folder), len(unique))
        changed: list[str] = []
        try:
            for path, mode, oid, size in unique:
                data = _BlobReader(os.path.join(root, path), int(mode), int(size))
                try:
                    writer.add(TYPE_CODES[b"blob"], int(size), str(oid), data.read)
                except (packformat.BadPack, _Changed):
                    changed.append(str(path))
                    break
                finally:
                    data.close()
            if not changed:
                writer.finish()
        finally:
            if changed or not writer.fh.closed:
                writer.discard()
        if changed:
            more = [str(r[0]) for r in rows if str(r[0]) not in changed and _differs(root, r)]
            changed += more
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise RemoteError(
                f"{len(changed)} file(s) changed while being sent: {shown}",
                hint="rerun once they stop changing (or .rvignore files a running program writes)",
            )

    def has(self, oid: str) -> bool:
        if not oid:
            return False
        return self.run(["cat-file", "-e", oid], ok=(0, 1, 128)).returncode == 0

    # -- what to send -----------------------------------------------------------------------------
    def objects(self, commit: str, bases: Sequence[str], sizes: dict[str, int]) -> Sends:
        """Everything ``commit`` reaches and the commits ``bases`` do not, split into the structure
        (commit, trees) and blobs; ``sizes`` gives blob sizes by id (anything else is a tree)."""
        trees = self.root_trees(bases)
        usable = [b for b in bases if b in trees]
        # Minus the bases' root trees, not their commits: a tree after --not marks what it reaches
        # uninteresting, so only the part of the new tree that differs is walked (the commits have
        # no parent: without the aggressive edge walk rev-list would leave out nothing they reach).
        not_ = ["--not", *(trees[b] for b in usable)] if usable else []
        out = self.run(["rev-list", "--objects", commit, *not_]).stdout
        sends = Sends(bases=usable)
        for line in out.split(b"\n"):
            if len(line) < 40:
                continue
            oid, path = line[:40].decode("ascii"), manifest.dec(line[41:])
            if oid in sizes:
                sends.blobs.append(Obj(oid, path, sizes[oid]))
            else:
                sends.structure.append(Obj(oid, path))
        return sends

    def root_trees(self, commits: Sequence[str]) -> dict[str, str]:
        """{commit: its root tree} of those of ``commits`` this repository holds (one git call)."""
        if not commits:
            return {}
        listing = "".join(f"{c}^{{tree}}\n" for c in commits).encode("ascii")
        out = self.run(["cat-file", "--batch-check=%(objectname) %(objecttype)"], input=listing).stdout
        answers = out.decode("ascii", "replace").splitlines()
        return {
            c: a.split()[0]
            for c, a in zip(commits, answers, strict=False)
            if a.endswith(" tree") and len(a.split()[0]) == 40
        }

    def everything(self, commit: str, rows: Iterable[Sequence[Any]]) -> Sends:
        """Every object of ``commit``: its commit and trees (git lists them, blobs left out), and the
        blobs of ``rows``, the snapshot's manifest rows (each id once): no lookup per blob."""
        out = self.run(["rev-list", "--objects", "--filter=blob:none", commit]).stdout
        sends = Sends()
        for line in out.split(b"\n"):
            if len(line) >= 40:
                sends.structure.append(Obj(line[:40].decode("ascii"), manifest.dec(line[41:])))
        seen: set[str] = set()
        for path, mode, oid, size in rows:
            if oid not in seen and int(mode) != MODE_GITLINK:
                seen.add(oid)
                sends.blobs.append(Obj(oid, path, int(size)))
        return sends

    def below(self, trees: Sequence[str]) -> list[tuple[str, str]]:
        """(id, path) of every object under the trees ``trees`` (paths relative to each)."""
        if not trees:
            return []
        out = self.run(["rev-list", "--objects", *trees]).stdout
        return [
            (line[:40].decode("ascii"), manifest.dec(line[41:]))
            for line in out.split(b"\n")
            if len(line) >= 40
        ]

    def remember(self, sid: str, commit: str) -> None:
        """A ref for a snapshot the cluster holds: its objects stay here while it may serve as a base."""
        self.run(["update-ref", f"refs/rv/snapshots/{sid}", commit])

    def commit_of(self, sid: str) -> str | None:
        """The commit of a snapshot this repository remembers, when its objects are all here."""
        got = self.run(["rev-parse", "-q", "--verify", f"refs/rv/snapshots/{sid}^{{commit}}"], ok=(0, 1, 128))
        commit = got.stdout.decode("ascii", "replace").strip()
        if got.returncode != 0 or not commit:
            return None
        whole = self.run(["rev-list", "--objects", "--missing=print", commit], ok=(0, 1, 128))
        return commit if whole.returncode == 0 and b"\n?" not in b"\n" + whole.stdout else None

    def tidy(self) -> None:
        """git's own rule for when loose objects pile up here (the blobs of files edited between
        snapshots): past gc.auto's 6,700 it packs what the remembered snapshots and the index reach
        (never what the alternates hold) and drops the rest an hour old. In the foreground: a
        detached gc would outlive the rv command that started it."""
        self.run(
            ["-c", "gc.autoDetach=false", "-c", "gc.pruneExpire=1.hour.ago", "gc", "--auto", "--quiet"],
            ok=(0, 1, 128),
        )

    # -- packs ------------------------------------------------------------------------------------
    def stream(
        self,
        commit: str,
        sends: Sends,
        progress: ProgressCounter | None = None,
        rate: float | None = None,
        measured: Callable[[], float | None] | None = None,
    ) -> Iterator[bytes]:
        """The packs of ``sends`` framed for the agent (rv.agent.store.receive_packs), made as suits a
        link of ``rate`` bytes/s (None: not measured; rv.files.link.choose). ``measured`` gives the
        rate this upload has measured so far, which the packs of whole objects follow as they are
        made (each pack of small objects as it starts, each large object as it is read): a first
        send, with no rate kept, compresses once its first megabytes have shown the link slow.

        An edit of a snapshot the cluster holds (``sends.bases``) where deltas pay: one thin
        pack, made by pack-objects' own walk from ``commit`` minus what the bases reach (--thin
        needs that walk: the bases' objects are what a delta may refer to and the pack leave out).
        An edit otherwise: its trees as deltas and its blobs whole (below). Anything else (a first
        send, what the store says it lacks): whole objects by chunks, each as two packs: its small
        objects made by pack-objects and taken in by git's index-pack (C, per object), its large
        blobs sent whole and written into a pack by
        rv.agent.packfile (index-pack's collision-detecting SHA-1 over their bytes cost as much as
        the whole tar stream a user compares with; the agent's Python costs per object instead).
        """
        choice = link.choose(sends.blob_bytes, rate, PACK_COMPRESSION)
        level = choice.level

        def level_now() -> int:
            return link.level_now(rate, measured() if measured is not None else None, PACK_COMPRESSION)

        if sends.bases and choice.deltas:
            revs = f"{commit}\n" + "".join(f"^{b}\n" for b in sends.bases)
            count = len(sends.blobs) + len(sends.structure)
            # --shallow: pack-objects' walk with aggressive edges (its plain --thin one leaves out
            # only what a parent reaches).
            shown = _Shown(progress, sends.blob_bytes)
            yield from self._pack(["--revs", "--thin", "--shallow"], revs.encode(), count, shown, level)
            shown.finish(len(sends.blobs))
        elif sends.bases:
            # One thin pack: the commit and trees as deltas against the bases' trees at the same
            # paths (the "-<commit>" lines, first: pack-objects' preferred bases), so a folder of
            # many files with one edited costs a few bytes; the small blobs whole in it (named
            # under NO_DELTA: the store's attributes turn the delta search off for them); large
            # blobs whole, after it.
            small = [o for o in sends.blobs if o.size < WHOLE_MIN_BYTES][:CHUNK_OBJECTS]
            kept = {o.oid for o in small}
            large = [o for o in sends.blobs if o.oid not in kept]
            edges = "".join(f"-{b}\n" for b in sends.bases).encode("ascii")
            listing = edges + _listing(sends.structure) + _listing(small, NO_DELTA)
            shown = _Shown(progress, sum(o.size for o in small))
            yield from self._pack(["--thin-list"], listing, len(sends.structure) + len(small), shown, level)
            shown.finish(len(small))
            yield from self._whole(Sends(blobs=large), progress, level_now)
        elif sends:
            yield from self._whole(sends, progress, level_now)
        yield PACKS_END
        if progress:
            progress.done()

    def _whole(
        self, sends: Sends, progress: ProgressCounter | None, level_now: Callable[[], int]
    ) -> Iterator[bytes]:
        """The packs of ``sends``, whole objects, by chunks, each at the level ``level_now`` says as
        it starts."""
        blobs = {o.oid for o in sends.blobs}
        chunks = _chunks(sends)
        whole = [o.oid for chunk in chunks for o in chunk if o.size >= WHOLE_MIN_BYTES]
        with self._objects(whole) as read:
            for chunk in chunks:
                level = level_now()
                shown = _Shown(progress, sum(o.size for o in chunk if o.oid in blobs))
                small = [o for o in chunk if o.size < WHOLE_MIN_BYTES]  # the commit and trees too
                if small:
                    yield from self._pack([], _listing(small), len(small), shown, level)
                if len(small) < len(chunk):
                    large = [o for o in chunk if o.size >= WHOLE_MIN_BYTES]
                    yield from _whole_pack(large, read, shown, level_now)
                shown.finish(sum(1 for o in chunk if o.oid in blobs))

    @contextlib.contextmanager
    def _objects(self, oids: list[str]) -> Iterator[_ObjectReader]:
        """``git cat-file --batch`` over ``oids``, in their order: each object's type, size and bytes
        (from this repository or its alternates, the user's repositories)."""
        if not oids:
            yield _ObjectReader(io.BytesIO(), self.path)
            return
        proc = subprocess.Popen(
            [self.git.executable, "cat-file", "--batch"],
            cwd=self.path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **self.env()},
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        listing = "".join(f"{oid}\n" for oid in oids).encode("ascii")
        feeder = threading.Thread(target=_feed, args=(proc.stdin, listing), daemon=True, name="rv-cat-file")
        feeder.start()
        try:
            yield _ObjectReader(proc.stdout, self.path)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            feeder.join()

    def _pack(self, how: list[str], listing: bytes, count: int, shown: _Shown, level: int) -> Iterator[bytes]:
        thin = "--thin" in how or "--thin-list" in how
        window = 10 if thin and count <= DELTA_OBJECTS else 0
        # --thin-list: a list of objects after "-<commit>" lines, whose trees are preferred bases
        # (deltas against them; they are left out). pack-objects' --thin would read revisions.
        how = [h for h in how if h != "--thin-list"]
        args = [
            "-c", f"pack.compression={level}", "pack-objects", "--stdout", "-q",
            "--delta-base-offset", f"--window={window}", *how,
        ]  # fmt: skip
        proc = subprocess.Popen(
            [self.git.executable, *args],
            cwd=self.path, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **self.env()},
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        try:
            proc.stdin.write(listing)  # pack-objects reads the whole list before it writes
            proc.stdin.close()
            while True:
                data = (
                    proc.stdout.read1(FRAME_MAX)
                    if hasattr(proc.stdout, "read1")
                    else proc.stdout.read(FRAME_MAX)
                )
                if not data:
                    break
                yield PACK_DATA + struct.pack(">I", len(data)) + data
                shown.add(len(data))
            err = proc.stderr.read()
            if proc.wait() != 0:
                raise GitError(
                    f"git pack-objects failed in {self.path}: {err.decode('utf-8', 'replace')[-400:]}"
                )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        yield PACK_END


class _Shown:
    """Progress in the blobs' bytes: a pack's bytes count as they go, up to its blobs' bytes (headers
    and trees add a little, deltas take some away), and the rest when the pack ends."""

    def __init__(self, progress: ProgressCounter | None, blob_bytes: int) -> None:
        self.progress, self.left = progress, blob_bytes

    def add(self, n: int) -> None:
        if self.progress is not None and self.left > 0:
            step = min(n, self.left)
            self.left -= step
            self.progress.add(step)

    def finish(self, files: int) -> None:
        if self.progress is not None:
            self.progress.add(self.left, files=files)
            self.left = 0


def _feed(pipe: Any, data: bytes) -> None:
    """Write ``data`` to a process's stdin and close it (a thread's: the process answers as it reads)."""
    with contextlib.suppress(OSError):  # the process was stopped: the reader says why
        pipe.write(data)
    with contextlib.suppress(OSError):
        pipe.close()


class _ObjectReader:
    """Reads ``git cat-file --batch``'s answers: a header line, then the object's bytes."""

    def __init__(self, out: Any, where: Path) -> None:
        self.out, self.where = out, where

    def header(self, oid: str) -> tuple[int, int]:
        """The type code and size of the next object, which must be ``oid``."""
        line = self.out.readline().split()
        if len(line) != 3 or line[0].decode("ascii", "replace") != oid or line[1] not in TYPE_CODES:
            shown = b" ".join(line).decode("utf-8", "replace") or "nothing"
            raise GitError(f"git cat-file in {self.where} answered {shown!r} for {oid}")
        return TYPE_CODES[line[1]], int(line[2])

    def read(self, n: int) -> bytes:
        data = self.out.read(n)
        if len(data) != n:
            raise GitError(f"git cat-file in {self.where} stopped in the middle of an object")
        return bytes(data)


def _whole_pack(
    chunk: list[Obj], read: _ObjectReader, shown: _Shown, level_now: Callable[[], int] = lambda: 0
) -> Iterator[bytes]:
    """One ``W`` pack: its count, then each object of ``chunk`` as ``O <type> <size> <id> <bytes>``,
    in frames of about FRAME_MAX (many small objects go in one). Where ``level_now`` says a level
    above 0 as an object starts (a slow link; asked for each: the packs are made ahead of the link,
    which a first send measures as it goes), an object whose first bytes compress goes as ``Z <type>
    <size> <id>`` and its zlib stream at that level in pieces (``<len:4> <bytes>``..., a length of 0
    after the last); the agent writes the stream into its pack as it came, once inflated to check
    the object's id."""
    out = bytearray(WHOLE_PACK + struct.pack(">I", len(chunk)))
    for o in chunk:
        level = level_now()
        kind, size = read.header(o.oid)
        first = read.read(min(FRAME_MAX, size))
        head = struct.pack(">BQ", kind, size) + bytes.fromhex(o.oid)
        trial = first[:TRIAL_BYTES]
        deflate = level > 0 and len(zlib.compress(trial, level)) < TRIAL_RATIO * len(trial)
        out += (DEFLATED if deflate else OBJECT) + head
        packer = zlib.compressobj(level) if deflate else None
        left, piece = size - len(first), first
        while True:
            shown.add(len(piece))
            if packer is None:
                out += piece
            elif packed := packer.compress(piece) + (b"" if left else packer.flush()):
                out += struct.pack(">I", len(packed)) + packed
            if len(out) >= FRAME_MAX:
                yield bytes(out)
                out.clear()
            if not left:
                break
            piece = read.read(min(FRAME_MAX, left))
            left -= len(piece)
        if packer is not None:
            out += struct.pack(">I", 0)
        read.read(1)  # the newline after each object
    out += PACK_END
    yield bytes(out)


def _chunks(sends: Sends) -> list[list[Obj]]:
    """The packs of a send: everything in one when small; else the commit and trees, then blobs by
    CHUNK_BYTES / CHUNK_OBJECTS."""
    if sends.blob_bytes <= CHUNK_BYTES and len(sends.blobs) + len(sends.structure) <= CHUNK_OBJECTS:
        return [sends.structure + sends.blobs] if sends else []
    out = [list(sends.structure)] if sends.structure else []
    current: list[Obj] = []
    size = 0
    for o in sends.blobs:
        if current and (size + o.size > CHUNK_BYTES or len(current) >= CHUNK_OBJECTS):
            out.append(current)
            current, size = [], 0
        current.append(o)
        size += o.size
    if current:
        out.append(current)
    return out


class _Changed(Exception):
    """A file no longer holds the bytes it was listed with (it shrank)."""


class _BlobReader:
    """A blob's bytes as listed: a file's, or a symlink's target (its blob; hash-object would
    follow the link). ``read(n)`` gives exactly ``n`` bytes, and nothing may follow the last of
    them, or it raises _Changed."""

    def __init__(self, full: str, mode: int, size: int) -> None:
        self.fh: Any = None
        self.left = size
        if mode == MODE_LINK:
            try:
                target = os.fsencode(os.readlink(full))
            except OSError:
                target = b""
            self.fh = io.BytesIO(target)
        else:
            try:
                self.fh = open(full, "rb")  # noqa: SIM115 (closed by close())
            except OSError:
                self.fh = io.BytesIO()

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        self.left -= len(data)
        if len(data) != n or (self.left == 0 and self.fh.read(1)):
            raise _Changed  # shrank, or grew
        return bytes(data)

    def close(self) -> None:
        self.fh.close()


def _differs(root: Path, row: Sequence[Any]) -> bool:
    """Does the file of ``row`` (after one was found changed) no longer hash to its id?"""
    reader = _BlobReader(os.path.join(root, row[0]), int(row[1]), int(row[3]))
    try:
        data = reader.read(int(row[3])) if int(row[3]) else b""
    except _Changed:
        return True
    finally:
        reader.close()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != str(row[2])


def _listing(objects: Sequence[Obj], prefix: str = "") -> bytes:
    """pack-objects' input: a line ``<id> <path>`` per object (the path for its delta heuristic)."""
    pre = _enc(prefix)
    return b"".join(o.oid.encode() + b" " + pre + _enc(o.path).replace(b"\n", b" ") + b"\n" for o in objects)


def _index_line(row: Sequence[Any]) -> bytes:
    return f"{int(row[1]):o} {row[2]}\t".encode("ascii") + _enc(row[0]) + b"\0"


def _removal(path: str) -> bytes:
    return b"0 " + b"0" * 40 + b"\t" + _enc(path) + b"\0"


def _enc(path: str) -> bytes:
    return path.encode("utf-8", "surrogateescape")


def open_local_store(cache_dir: Path, tree: LocalTree, git: Git) -> LocalStore:
    return LocalStore(cache_dir / "git" / store_name(tree.root), git, tree.object_dirs)
