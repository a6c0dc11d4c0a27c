"""Push, pull, watch and garbage collection: plans are pure functions, applying them is one round trip.

Every operation is at most two remote commands over the one SSH connection, whatever the number of
files: a ``scan`` (what is there: size, mtime and mode; blob ids only where the quick check cannot
decide), then one command that carries all the data (``apply`` for push, ``send`` for pull). The
cluster side is :mod:`rv.agent.transfer`.

push mirrors a local folder (the repo's files, by the same rules as a snapshot) into a remote one:
new and changed files are uploaded, files gone locally are deleted there, except what local ignore
rules (``.gitignore``, ``.rvignore``) match: like ``rsync --delete`` without ``--delete-excluded``,
so outputs a job writes into an ignored folder of its workspace survive the next push.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rv.agent import manifest
from rv.errors import NotFound, RemoteError, UsageError
from rv.files.listing import MODE_EXEC, Entry, Git, LocalTree, blob_id, hash_path, ignored_paths, scan_tree
from rv.files.progress import Progress, ProgressCounter
from rv.files.provenance import project_key
from rv.files.snapshot import DEFAULT_MAX_FILE_SIZE, check_sizes
from rv.layout import RemoteLayout
from rv.remote.agent_client import call_agent, frame
from rv.units import human_size, parse_size

if TYPE_CHECKING:
    from rv.files.treecache import TreeCache
    from rv.remote.transport import Transport

# --------------------------------------------------------------------------------------------------
# Remote listings


@dataclass(frozen=True, slots=True)
class RemoteEntry:
    path: str  # relative to the scanned folder; "" when a single file was scanned
    kind: str  # "f" file, "l" symlink, "d" folder
    mode: int  # permission bits
    size: int
    mtime_ns: int
    extra: str | None = None  # symlink target, or the blob id when the scan was asked to hash it


@dataclass(frozen=True)
class RemoteListing:
    kind: str  # "dir", "file" or "missing"
    path: str  # as resolved on the cluster
    entries: tuple[RemoteEntry, ...]


def scan_remote(
    transport: Transport,
    layout: RemoteLayout,
    remote_path: str,
    *,
    quick: dict[str, list[int]] | None = None,
    skip_git: bool = False,
) -> RemoteListing:
    """One round trip: list ``remote_path``; hash the files ``quick`` lists with its size but not mtime."""
    args = layout.agent_args(path=remote_path, skip_git=skip_git)
    r = call_agent(transport, "scan", args, stdin=frame({"local": quick or {}}))
    return RemoteListing(r["kind"], r["path"], tuple(RemoteEntry(*e) for e in r["entries"]))


# --------------------------------------------------------------------------------------------------
# Push


@dataclass(frozen=True)
class PushPlan:
    upload: tuple[Entry, ...] = ()
    delete: tuple[str, ...] = ()
    rmdir: tuple[str, ...] = ()
    chmod: tuple[tuple[str, int], ...] = ()
    touch: tuple[tuple[str, int], ...] = ()  # same content, other mtime: only the mtime is set
    symlink: tuple[tuple[str, str], ...] = ()
    kept: tuple[str, ...] = ()  # only on the cluster, but matched by ignore rules: left alone
    unchanged: int = 0

    @property
    def empty(self) -> bool:
        return not (self.upload or self.delete or self.rmdir or self.chmod or self.touch or self.symlink)

    @property
    def upload_bytes(self) -> int:
        return sum(e.size for e in self.upload)

    def lines(self) -> list[str]:
        """What the push does, one action per line, sorted by path (the dry-run output)."""
        rows: list[tuple[str, str]] = []
        rows += [(e.path, f"upload  {e.path} ({human_size(e.size)})") for e in self.upload]
        rows += [(p, f"delete  {p}") for p in self.delete]
        rows += [(p + "/\udcff", f"rmdir   {p}/") for p in self.rmdir]  # after what was inside it
        rows += [(p, f"chmod   {p} {m:o}") for p, m in self.chmod]
        rows += [(p, f"touch   {p}") for p, _ in self.touch]
        rows += [(p, f"link    {p} -> {t}") for p, t in self.symlink]
        return [line for _, line in sorted(rows, key=lambda r: (manifest.enc(r[0]), r[1]))]

    def summary(self) -> str:
        parts = [
            f"{len(self.upload)} to upload ({human_size(self.upload_bytes)})",
            f"{len(self.delete)} to delete",
        ]
        if self.symlink:
            parts.append(f"{len(self.symlink)} symlink(s)")
        if self.chmod or self.touch:
            parts.append(f"{len(self.chmod) + len(self.touch)} metadata update(s)")
        if self.rmdir:
            parts.append(f"{len(self.rmdir)} folder(s) to remove")
        parts.append(f"{self.unchanged} unchanged")
        if self.kept:
            parts.append(f"{len(self.kept)} ignored on the cluster kept")
        return ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "upload": [{"path": e.path, "size": e.size} for e in self.upload],
            "delete": list(self.delete),
            "rmdir": list(self.rmdir),
            "chmod": [{"path": p, "mode": f"{m:o}"} for p, m in self.chmod],
            "touch": [p for p, _ in self.touch],
            "symlink": [{"path": p, "target": t} for p, t in self.symlink],
            "kept": list(self.kept),
            "unchanged": self.unchanged,
        }


def _ancestors(path: str) -> Iterator[str]:
    parts = path.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def plan_push(
    local: tuple[Entry, ...] | list[Entry],
    remote: tuple[RemoteEntry, ...] | list[RemoteEntry],
    link_targets: dict[str, str],
    protected: set[str],
) -> PushPlan:
    """Pure: what makes the remote folder equal the local files.

    ``protected``: remote-only paths (files, links, or folders) that local ignore rules match; they
    and everything under them stay. Equal size and mtime means unchanged (rsync's quick check);
    otherwise a blob id from the scan decides between a metadata-only update and an upload.
    """
    here = {e.path: e for e in local}
    there = {r.path: r for r in remote}
    local_dirs = {d for p in here for d in _ancestors(p)}
    upload, chmod, touch, symlink = [], [], [], []
    unchanged = 0
    for p, e in here.items():
        r = there.get(p)
        if e.is_link:
            target = link_targets[p]
            if r is not None and r.kind == "l" and r.extra == target:
                unchanged += 1
            else:
                symlink.append((p, target))
            continue
        want = 0o755 if e.mode == MODE_EXEC else 0o644
        if r is None or r.kind != "f":
            upload.append(e)
            continue
        if r.size == e.size and manifest.same_mtime(r.mtime_ns, e.mtime_ns):
            unchanged += 1
        elif r.extra is not None and r.extra == e.oid:
            touch.append((p, e.mtime_ns))
        else:
            upload.append(e)
            continue
        if bool(r.mode & 0o100) != (want == 0o755):
            chmod.append((p, want))

    def is_protected(path: str) -> bool:
        return path in protected or any(a in protected for a in _ancestors(path))

    delete, kept = [], []
    for p, r in there.items():
        if p in here or r.kind == "d":
            continue
        if is_protected(p):
            kept.append(p)
        else:
            delete.append(p)
    keep_dirs = {a for p in kept for a in _ancestors(p)} | local_dirs
    rmdir = [
        p for p, r in there.items()
        if r.kind == "d" and p not in keep_dirs and p not in here and not is_protected(p)
    ]  # fmt: skip
    return PushPlan(
        upload=tuple(upload),
        delete=tuple(sorted(delete)),
        rmdir=tuple(sorted(rmdir)),
        chmod=tuple(chmod),
        touch=tuple(touch),
        symlink=tuple(symlink),
        kept=tuple(sorted(kept)),
        unchanged=unchanged,
    )


@dataclass(frozen=True)
class PushResult:
    local: Path
    remote: str  # as given or derived (workspace)
    remote_resolved: str  # as the cluster resolved it
    plan: PushPlan
    applied: bool
    tree_id: str  # the snapshot id the local files would have: `watch` compares these
    warnings: tuple[str, ...] = ()
    uploaded: int = 0
    uploaded_bytes: int = 0
    deleted: int = 0


def _local_tree(
    local: Path | None, git: Git, cache: TreeCache | None, *, with_mtimes: bool = False
) -> tuple[LocalTree, LocalTree]:
    """(the whole repo or folder, the part under ``local``); ``None``: the repo holding the cwd, whole."""
    full = scan_tree(local or ".", git=git, cache=cache, with_mtimes=with_mtimes)
    if local is None or local.resolve() == full.root:
        return full, full
    return full, full.subtree(local.resolve().relative_to(full.root).as_posix())


def default_remote(tree: LocalTree, layout: RemoteLayout, git: Git, cache_dir: Path | None = None) -> str:
    branch = (tree.repo.branch if tree.repo else None) or "detached"
    return layout.workspace(project_key(tree, git, cache_dir), branch)


def _is_workspace(remote: str, layout: RemoteLayout) -> bool:
    ws = layout.workspace("x", "y").rsplit("/", 2)[0] + "/"
    return remote.startswith(ws) or remote.startswith("workspaces/")


def push(
    transport: Transport,
    layout: RemoteLayout,
    local: str | Path | None = None,
    remote: str | None = None,
    *,
    dry_run: bool = False,
    force: bool = False,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    allow_large: bool = False,
    git: Git | None = None,
    cache_dir: Path | None = None,
    cache: TreeCache | None = None,
    on_plan: Callable[[PushPlan], None] | None = None,
    on_progress: Progress | None = None,
) -> PushResult:
    """Mirror ``local`` (default: the repo) into ``remote`` (default: the project's branch workspace).

    Local work (listing, hashing, size checks) happens before the first remote command. Deleting
    files in a folder outside ``<root>/workspaces`` needs ``force``: a mistyped REMOTE must not
    empty someone's home folder.
    """
    git = git or Git()
    local_path = Path(local) if local is not None else None
    if local_path is not None and not local_path.is_dir():
        raise UsageError(f"{local} is not a folder", hint="push mirrors a folder (default: this repo)")
    full, tree = _local_tree(local_path, git, cache, with_mtimes=True)
    check_sizes(tree, max_file_size, allow_large)
    if remote is None:
        remote = default_remote(full, layout, git, cache_dir)
    quick = {e.path: [e.size, e.mtime_ns] for e in tree.entries if not e.is_link}
    listing = scan_remote(transport, layout, remote, quick=quick, skip_git=True)
    if listing.kind == "file":
        raise UsageError(f"{remote} is a file on the cluster, not a folder", hint="give a folder as REMOTE")
    links = {e.path: os.readlink(tree.root / e.path) for e in tree.entries if e.is_link}
    protected = _protected(full, tree, listing, git)
    plan = plan_push(tree.entries, listing.entries, links, protected)
    if on_plan:
        on_plan(plan)
    tid = tree.id
    base = PushResult(tree.root, remote, listing.path, plan, False, tid, tree.warnings)
    if dry_run or plan.empty:
        return base
    if plan.delete and not force and not _is_workspace(remote, layout) and listing.kind == "dir":
        shown = ", ".join(plan.delete[:5]) + (" ..." if len(plan.delete) > 5 else "")
        raise UsageError(
            f"pushing to {remote} would delete {len(plan.delete)} file(s) there that are not here: {shown}",
            hint="check REMOTE; rerun with --dry-run to see everything, --force to go ahead",
        )
    header = frame(
        {
            "delete": list(plan.delete),
            "upload": [
                [e.path, 0o755 if e.mode == MODE_EXEC else 0o644, e.size, e.oid, e.mtime_ns]
                for e in plan.upload
            ],
            "symlink": [list(s) for s in plan.symlink],
            "chmod": [list(c) for c in plan.chmod],
            "touch": [list(t) for t in plan.touch],
            "rmdir": list(plan.rmdir),
        }
    )
    r = call_agent(
        transport,
        "apply",
        layout.agent_args(path=remote),
        stdin=_upload_stream(tree.root, header, plan.upload, on_progress),
    )
    if r["bad"]:
        raise RemoteError(
            f"{len(r['bad'])} file(s) changed while being pushed and were not written: "
            + ", ".join(r["bad"][:5]),
            hint="rerun the push once they stop changing",
        )
    return PushResult(
        tree.root,
        remote,
        listing.path,
        plan,
        True,
        tid,
        tree.warnings,
        r["uploaded"],
        r["uploaded_bytes"],
        r["deleted"],
    )


def _protected(full: LocalTree, tree: LocalTree, listing: RemoteListing, git: Git) -> set[str]:
    """Remote-only paths the local ignore rules match (so a push leaves them alone)."""
    here = {e.path for e in tree.entries}
    only_there = [r for r in listing.entries if r.path not in here]
    if not only_there:
        return set()
    # Folders are asked about through a placeholder inside them, so "outputs/" patterns match.
    probe = {}
    prefix = "" if tree.root == full.root else tree.root.relative_to(full.root).as_posix() + "/"
    for r in only_there:
        key = prefix + (r.path + "/.rv-probe" if r.kind == "d" else r.path)
        probe[key] = r.path
    info_exclude = [full.repo.git_dir / "info" / "exclude"] if full.repo else []
    hit = ignored_paths(full.root, probe, git)
    if full.repo:
        hit |= ignored_paths(full.root, probe, git, gitignore=True, exclude_from=info_exclude)
    return {probe[k] for k in hit}


def _upload_stream(
    root: Path, header: bytes, files: tuple[Entry, ...], on_progress: Progress | None
) -> Iterator[bytes]:
    """The push stream: header, then each upload's exact bytes in plan order, then ``E``."""
    yield header
    progress = ProgressCounter(on_progress, "upload", len(files), sum(e.size for e in files))
    buf = bytearray()
    for e in files:
        left = e.size
        try:
            fh = open(root / e.path, "rb")  # noqa: SIM115 (closed below; the generator may pause)
        except OSError:
            fh = None
        try:
            while left:
                data = fh.read(min(1 << 20, left)) if fh else b""
                if not data:
                    data = b"\0" * min(1 << 20, left)  # shrank: the cluster will refuse the blob id
                buf += data
                left -= len(data)
                if len(buf) >= 1 << 20:
                    yield bytes(buf)
                    buf.clear()
                progress.add(len(data))
        finally:
            if fh:
                fh.close()
        progress.add(files=1)
    buf += b"E"
    yield bytes(buf)
    progress.done()


# --------------------------------------------------------------------------------------------------
# Pull


@dataclass(frozen=True)
class PullPlan:
    download: tuple[tuple[str, str | None], ...]  # (path, local blob id when only the mtime differs)
    mkdir: tuple[str, ...]
    symlink: tuple[tuple[str, str], ...]
    unchanged: int
    total_bytes: int  # of the files to download


def plan_pull(
    remote: tuple[RemoteEntry, ...], local: dict[str, os.stat_result | None], local_ids: dict[str, str]
) -> PullPlan:
    """Pure: which remote entries to fetch.

    ``local`` maps each remote path to the local lstat (None: absent); ``local_ids`` holds blob ids
    of local files with the remote size but another mtime, so the cluster can skip sending those
    when the content is the same.
    """
    download, mkdir, symlink = [], [], []
    unchanged = total = 0
    for r in remote:
        st = local.get(r.path)
        if r.kind == "d":
            if st is None or not stat.S_ISDIR(st.st_mode):
                mkdir.append(r.path)
            continue
        if r.kind == "l":
            if st is None or not stat.S_ISLNK(st.st_mode) or local_ids.get(r.path) != r.extra:
                symlink.append((r.path, r.extra or ""))
            else:
                unchanged += 1
            continue
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == r.size:
            if manifest.same_mtime(st.st_mtime_ns, r.mtime_ns):
                unchanged += 1
                continue
            download.append((r.path, local_ids.get(r.path)))
        else:
            download.append((r.path, None))
        total += r.size
    return PullPlan(tuple(download), tuple(mkdir), tuple(symlink), unchanged, total)


@dataclass(frozen=True)
class PullResult:
    remote: str
    local: Path
    downloaded: int
    downloaded_bytes: int
    same_content: int  # only the mtime differed: nothing was sent
    unchanged: int
    warnings: tuple[str, ...] = ()
    kept_local: tuple[str, ...] = ()  # changed here since the last pull, left alone (--keep-local)
    overwritten: tuple[str, ...] = ()  # changed here since the last pull, replaced (--force)


class PullConflict(UsageError):
    """Local files changed since they were last pulled would be overwritten: nothing was changed."""

    def __init__(self, paths: list[str], where: Path) -> None:
        shown = ", ".join(paths[:10]) + (f" and {len(paths) - 10} more" if len(paths) > 10 else "")
        super().__init__(
            f"{len(paths)} local file(s) in {where} changed since they were last pulled (or were never "
            f"pulled) and differ from the cluster's: {shown}; nothing was changed",
            hint="pass --force to overwrite them with the cluster's version, or --keep-local to keep "
            "them and pull everything else",
        )
        self.paths = paths


class PullLedger:
    """What each pull left in each local file: (size, mtime_ns, blob id), by absolute path.

    A local file whose size and mtime (or, failing those, content) still match is the one rv
    wrote, so pulling over it loses nothing; any other local file in the way is the user's work.
    ``path`` None keeps the ledger in memory only (API callers that manage no state).
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, list[Any]] = {}
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text(encoding="utf-8")).get("files", {})
            except ValueError as exc:
                raise UsageError(
                    f"{path} (rv's record of pulled files) is damaged: {exc}",
                    hint=f"remove {path}; the next pull then treats every existing local file as yours",
                ) from exc
        self.dirty = False

    @staticmethod
    def key(path: Path) -> str:
        return os.path.normpath(os.path.abspath(path))

    def vouches(self, path: Path, st: os.stat_result, oid: str | None) -> bool:
        """Is the local file still exactly what the last pull left there?"""
        got = self.entries.get(self.key(path))
        if got is None:
            return False
        size, mtime, known_oid = got
        if st.st_size == size and st.st_mtime_ns == mtime:
            return True
        return oid is not None and oid == known_oid

    def record(self, path: Path, oid: str | None) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if stat.S_ISREG(st.st_mode):
            self.entries[self.key(path)] = [st.st_size, st.st_mtime_ns, oid]
            self.dirty = True

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Forget files that are gone, so the ledger does not grow forever.
        live = {k: v for k, v in self.entries.items() if os.path.lexists(k)}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({"files": live}, fh)
        os.replace(tmp, self.path)
        self.dirty = False


def _local_umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


class _PullWriter:
    """Parses the ``send`` stream as it arrives and writes each file by temp + rename."""

    HEAD: ClassVar[dict[bytes, int]] = {b"F": 24, b"S": 16, b"X": 8}  # header bytes after the tag

    def __init__(
        self,
        dest: Path,
        paths: list[str],
        total: int,
        on_progress: Progress | None,
        *,
        sizes: list[int] | None = None,
        local_ids: list[str | None] | None = None,
        ledger: PullLedger | None = None,
    ) -> None:
        self.dest = dest
        self.paths = paths
        self.sizes = sizes or [0] * len(paths)
        self.local_ids = local_ids or [None] * len(paths)
        self.ledger = ledger
        self.umask = _local_umask()
        self.buf = bytearray()
        self.progress = ProgressCounter(on_progress, "download", len(paths), total)
        self.file: Any = None  # the open temp file of the frame being received
        self.left = 0
        self.info: tuple[int, int, int, int] = (0, 0, 0, 0)
        self.hasher: Any = None
        self.finished = False
        self.downloaded = self.downloaded_bytes = self.same = 0
        self.warnings: list[str] = []

    @property
    def total(self) -> int:
        return self.progress.bytes_total

    @property
    def done(self) -> int:
        return self.progress.bytes_done

    def target(self, idx: int) -> Path:
        rel = self.paths[idx]
        return self.dest if rel == "" else self.dest / rel

    def feed(self, data: bytes) -> None:
        self.buf += data
        while self.buf and not self.finished:
            if self.file is not None:
                if not self._body():
                    return
                continue
            tag = bytes(self.buf[:1])
            if tag == b"E":
                self.finished = True
                del self.buf[:1]
                self.progress.done()
                return
            need = self.HEAD.get(tag)
            if need is None:
                raise RemoteError(f"pull: corrupt stream from the cluster (tag {tag!r})")
            if len(self.buf) < 1 + need:
                return
            head = bytes(self.buf[1 : 1 + need])
            if tag == b"F":
                idx, size, mtime, mode = struct.unpack(">IQqI", head)
                del self.buf[: 1 + need]
                self._open(idx, size, mtime, mode)
            elif tag == b"S":
                idx, mtime, mode = struct.unpack(">IqI", head)
                del self.buf[: 1 + need]
                path = self.target(idx)
                self._finish_meta(path, mtime, mode)
                if self.ledger is not None:
                    self.ledger.record(path, self.local_ids[idx])
                self.same += 1
                self.progress.add(self.sizes[idx], files=1)
            else:
                idx, n = struct.unpack(">II", head)
                if len(self.buf) < 1 + need + n:
                    return
                msg = bytes(self.buf[1 + need : 1 + need + n]).decode("utf-8", "replace")
                del self.buf[: 1 + need + n]
                self.warnings.append(f"{self.paths[idx] or self.dest.name}: not downloaded ({msg})")
                self.progress.add(self.sizes[idx], files=1)

    def _open(self, idx: int, size: int, mtime: int, mode: int) -> None:
        path = self.target(idx)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.rv-tmp-{uuid.uuid4().hex[:12]}")
        self.file = open(tmp, "wb")  # noqa: SIM115 (closed in _body when the frame completes)
        self.tmp = tmp
        self.left = size
        self.info = (idx, size, mtime, mode)
        self.hasher = manifest.blob_hasher(size)

    def _body(self) -> bool:
        if self.left:
            take = bytes(self.buf[: self.left])
            del self.buf[: len(take)]
            self.file.write(take)
            self.hasher.update(take)
            self.left -= len(take)
            self.progress.add(len(take))
            if self.left:
                return False
        if len(self.buf) < 21:
            return False
        digest, changed = bytes(self.buf[:20]), self.buf[20]
        del self.buf[:21]
        self.file.close()
        self.file = None
        idx, size, mtime, mode = self.info
        path = self.target(idx)
        if digest != self.hasher.digest():
            self.tmp.unlink(missing_ok=True)
            raise RemoteError(
                f"pull: {self.paths[idx]} arrived damaged (checksum mismatch); nothing was replaced"
            )
        if changed:
            self.warnings.append(f"{self.paths[idx] or path.name} changed on the cluster while it was read")
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()
        self._finish_meta(self.tmp, mtime, mode)
        os.replace(self.tmp, path)
        if self.ledger is not None:
            self.ledger.record(path, None if changed else digest.hex())
        self.downloaded += 1
        self.downloaded_bytes += size
        self.progress.add(files=1)
        return True

    def _finish_meta(self, path: Path, mtime: int, mode: int) -> None:
        # A pulled file is as private as the user's umask makes new files (as cp does).
        os.chmod(path, (0o777 if mode & 0o100 else 0o666) & ~self.umask)
        os.utime(path, ns=(mtime, mtime), follow_symlinks=False)

    def abort(self) -> None:
        if self.file is not None:
            self.file.close()
            self.tmp.unlink(missing_ok=True)
            self.file = None


ON_CONFLICT = ("refuse", "force", "keep-local")


def pull(
    transport: Transport,
    layout: RemoteLayout,
    remote: str,
    local: str | Path | None = None,
    *,
    on_progress: Progress | None = None,
    on_conflict: str = "refuse",
    ledger: PullLedger | None = None,
) -> PullResult:
    """Download a remote file or folder; only files whose size or mtime differ travel, and of those
    with the same size, only ones whose content differs (the cluster compares blob ids first).

    Relative REMOTE paths are under the profile's remote root; ``~/...`` is the remote home. Local
    files that are not on the cluster are left alone. A local file the cluster's version would
    replace must be the one the last pull left (``ledger``); if any is not (edited since, or never
    pulled), ``on_conflict`` decides: ``refuse`` (raise PullConflict before changing anything),
    ``force`` (overwrite) or ``keep-local`` (leave those, pull the rest). Each file lands by rename:
    an interrupted pull never leaves half a file.
    """
    if on_conflict not in ON_CONFLICT:
        raise UsageError(f"on_conflict must be one of {', '.join(ON_CONFLICT)}, not {on_conflict!r}")
    ledger = ledger if ledger is not None else PullLedger(None)
    listing = scan_remote(transport, layout, remote)
    if listing.kind == "missing":
        raise NotFound(
            f"{remote} does not exist on the cluster ({listing.path})",
            hint="check the path with `rv exec ls`",
        )
    name = posixpath.basename(listing.path.rstrip("/")) or "pulled"
    dest = Path(local) if local is not None else Path.cwd() / name
    if listing.kind == "file" and dest.is_dir():
        dest = dest / name
    if listing.kind == "dir" and dest.exists() and not dest.is_dir():
        raise UsageError(
            f"{dest} is a file here, but {remote} is a folder on the cluster", hint="pick another LOCAL"
        )
    local_stats: dict[str, os.stat_result | None] = {}
    local_ids: dict[str, str] = {}
    for r in listing.entries:
        path = dest if r.path == "" else dest / r.path
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        local_stats[r.path] = st
        if st is None:
            continue
        if r.kind == "d" and not stat.S_ISDIR(st.st_mode):
            raise UsageError(
                f"{path} is a file here but a folder on the cluster", hint="move it away and pull again"
            )
        if r.kind != "d" and stat.S_ISDIR(st.st_mode):
            raise UsageError(
                f"{path} is a folder here but a file on the cluster", hint="move it away and pull again"
            )
        if r.kind == "l" and stat.S_ISLNK(st.st_mode):
            local_ids[r.path] = os.readlink(path)
        elif (
            r.kind == "f"
            and stat.S_ISREG(st.st_mode)
            and st.st_size == r.size
            and not manifest.same_mtime(st.st_mtime_ns, r.mtime_ns)
        ):
            got = hash_path(path)
            if got:
                local_ids[r.path] = got[1]
    plan = plan_pull(listing.entries, local_stats, local_ids)
    conflicts = _conflicts(transport, layout, remote, dest, listing, plan, local_stats, local_ids, ledger)
    kept: tuple[str, ...] = ()
    overwritten: tuple[str, ...] = ()
    if conflicts:
        if on_conflict == "refuse":
            raise PullConflict(conflicts, dest)
        if on_conflict == "keep-local":
            kept = tuple(conflicts)
            skip = set(conflicts)
            sizes = {r.path: r.size for r in listing.entries}
            download = tuple(d for d in plan.download if d[0] not in skip)
            plan = PullPlan(
                download,
                plan.mkdir,
                tuple(s for s in plan.symlink if s[0] not in skip),
                plan.unchanged,
                sum(sizes[p] for p, _ in download),
            )
        else:
            overwritten = tuple(conflicts)
    # From here on local files change; everything that could refuse has refused.
    if listing.kind == "dir":
        dest.mkdir(parents=True, exist_ok=True)
    for d in plan.mkdir:
        (dest / d).mkdir(parents=True, exist_ok=True)
    for p, target in plan.symlink:
        link = dest / p
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(target, link)
    sizes_by_path = {r.path: r.size for r in listing.entries}
    writer = _PullWriter(
        dest,
        [p for p, _ in plan.download],
        plan.total_bytes,
        on_progress,
        sizes=[sizes_by_path[p] for p, _ in plan.download],
        local_ids=[i for _, i in plan.download],
        ledger=ledger,
    )
    try:
        if plan.download:
            errors: list[bytes] = []
            try:
                code = transport.stream(
                    _send_command(layout, remote),
                    on_stdout=writer.feed,
                    on_stderr=errors.append,
                    stdin=frame({"files": [list(d) for d in plan.download]}),
                )
            finally:
                writer.abort()
            if code != 0 or not writer.finished:
                tail = b"".join(errors).decode("utf-8", "replace").strip().splitlines()[-3:]
                raise RemoteError(
                    f"pull of {remote} failed (exit {code}): {' / '.join(tail) or 'stream ended early'}"
                )
        downloading = {p for p, _ in plan.download}
        for r in listing.entries:
            if r.kind == "f" and r.path not in downloading and r.path not in kept:
                path = dest if r.path == "" else dest / r.path
                known = ledger.entries.get(ledger.key(path))
                ledger.record(path, known[2] if known else None)  # unchanged: equal to the cluster's
    finally:
        ledger.save()  # what did arrive is recorded even when the pull stopped half way
    return PullResult(
        remote,
        dest,
        writer.downloaded,
        writer.downloaded_bytes,
        writer.same,
        plan.unchanged,
        tuple(writer.warnings),
        kept,
        overwritten,
    )


def _conflicts(
    transport: Transport,
    layout: RemoteLayout,
    remote: str,
    dest: Path,
    listing: RemoteListing,
    plan: PullPlan,
    local_stats: dict[str, os.stat_result | None],
    local_ids: dict[str, str],
    ledger: PullLedger,
) -> list[str]:
    """Local files the pull would replace that the ledger cannot vouch for (sorted)."""
    by_path = {r.path: r for r in listing.entries}
    suspects: list[str] = []
    same_size: dict[str, list[int]] = {}
    for p in [d for d, _ in plan.download] + [s for s, _ in plan.symlink]:
        st = local_stats.get(p)
        if st is None or stat.S_ISLNK(st.st_mode):
            continue  # nothing there, or a link replaced by a link: no work of the user's is lost
        path = dest if p == "" else dest / p
        if stat.S_ISREG(st.st_mode) and ledger.vouches(path, st, local_ids.get(p)):
            continue
        suspects.append(p)
        r = by_path[p]
        if p in local_ids and r.kind == "f":
            same_size[p] = [st.st_size, st.st_mtime_ns]
    if same_size:
        # Same size, another mtime: maybe only touched. Ask the cluster for those files' blob ids
        # (one more round trip, only in this case): identical content is not a conflict.
        again = scan_remote(transport, layout, remote, quick=same_size)
        theirs = {r.path: r.extra for r in again.entries}
        suspects = [p for p in suspects if not (p in same_size and theirs.get(p) == local_ids[p])]
    return sorted(suspects)


def _send_command(layout: RemoteLayout, remote: str) -> str:
    from rv.remote.agent_client import agent_command

    return agent_command("send", layout.agent_args(path=remote))


# --------------------------------------------------------------------------------------------------
# Watch


@dataclass
class WatchState:
    pushes: int = 0
    last_id: str | None = None
    errors: list[str] = field(default_factory=list)


def watch(
    push_once: Callable[[TreeCache], PushResult],
    current_id: Callable[[TreeCache], str],
    *,
    interval: float = 0.5,
    debounce: float = 0.5,
    on_push: Callable[[PushResult], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    max_pushes: int | None = None,
) -> WatchState:
    """Push now, then again whenever the local files change, once they have been still for ``debounce``.

    Changes are found by polling: ``current_id`` is the would-be snapshot id of the local files
    (listing plus stat; only changed files are hashed, through the shared hash cache), so any edit,
    new file, deletion, chmod or ignore-rule change is seen, and nothing else is. Runs until
    interrupted (Ctrl-C raises KeyboardInterrupt out of ``sleep``) or ``max_pushes`` pushes.
    """
    state = WatchState()
    from rv.files.treecache import TreeCache

    cache = TreeCache()  # in memory: the listing and hashes of the last look, reused by the next

    def do_push() -> None:
        try:
            result = push_once(cache)
        except (UsageError, RemoteError, NotFound) as exc:
            # Keep watching: the next save may fix it (a file over the size limit, a full disk).
            state.errors.append(str(exc))
            if on_error:
                on_error(exc)
            state.last_id = current_id(cache)
            return
        state.pushes += 1
        state.last_id = result.tree_id
        if on_push:
            on_push(result)

    do_push()
    while max_pushes is None or state.pushes < max_pushes:
        sleep(interval)
        now = current_id(cache)
        if now == state.last_id:
            continue
        while True:  # wait for the burst of saves to end
            sleep(debounce)
            later = current_id(cache)
            if later == now:
                break
            now = later
        do_push()
    return state


def tree_id(local: str | Path | None, git: Git | None = None, cache: TreeCache | None = None) -> str:
    """The snapshot id the files a push of ``local`` carries would have (cheap with a cache)."""
    _, tree = _local_tree(Path(local) if local is not None else None, git or Git(), cache)
    return tree.id


__all__ = [
    "PullConflict",
    "PullLedger",
    "PullPlan",
    "PullResult",
    "PushPlan",
    "PushResult",
    "RemoteEntry",
    "RemoteListing",
    "blob_id",
    "parse_size",
    "plan_pull",
    "plan_push",
    "pull",
    "push",
    "scan_remote",
    "tree_id",
    "watch",
]
