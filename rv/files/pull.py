"""Pull: a remote file or folder into a local one, one ``scan`` and one ``send`` round trip.

Only files whose size or mtime differ travel, and of those with the same size only the ones whose
content differs (the cluster compares blob ids first). A local file the cluster's version would
replace must be the one the last pull left (:class:`PullLedger`); each file lands by rename. The
cluster side is :mod:`rv.agent.transfer`; the remote listing, and push, are :mod:`rv.files.sync`'s.
"""

from __future__ import annotations

import json
import os
import posixpath
import stat
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from rv.agent import manifest
from rv.errors import NotFound, RemoteError, UsageError
from rv.files.listing import hash_path
from rv.files.progress import Progress, ProgressCounter
from rv.files.sync import RemoteEntry, RemoteListing, scan_remote
from rv.layout import RemoteLayout
from rv.remote.agent_client import frame

if TYPE_CHECKING:
    from rv.remote.transport import Transport


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
    dest = _destination(listing, remote, local)
    local_stats, local_ids = _local_state(listing, dest)
    plan = plan_pull(listing.entries, local_stats, local_ids)
    conflicts = _conflicts(transport, layout, remote, dest, listing, plan, local_stats, local_ids, ledger)
    kept: tuple[str, ...] = ()
    overwritten: tuple[str, ...] = ()
    if conflicts:
        if on_conflict == "refuse":
            raise PullConflict(conflicts, dest)
        if on_conflict == "keep-local":
            kept = tuple(conflicts)
            plan = _without(plan, set(conflicts), listing)
        else:
            overwritten = tuple(conflicts)
    # From here on local files change; everything that could refuse has refused.
    _make_folders_and_links(listing, plan, dest)
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
            _download(transport, layout, remote, plan, writer)
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


def _destination(listing: RemoteListing, remote: str, local: str | Path | None) -> Path:
    """Where REMOTE lands here (as cp names it); refuses a missing REMOTE or a folder over a file."""
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
    return dest


def _local_state(
    listing: RemoteListing, dest: Path
) -> tuple[dict[str, os.stat_result | None], dict[str, str]]:
    """The local stat of each listed path, and the blob id (or link target) of those that may be
    unchanged: a file of the same size whose mtime differs is hashed, one of the same mtime is not."""
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
    return local_stats, local_ids


def _without(plan: PullPlan, skip: set[str], listing: RemoteListing) -> PullPlan:
    """``plan`` less the paths in ``skip`` (the local files --keep-local keeps)."""
    sizes = {r.path: r.size for r in listing.entries}
    download = tuple(d for d in plan.download if d[0] not in skip)
    return PullPlan(
        download,
        plan.mkdir,
        tuple(s for s in plan.symlink if s[0] not in skip),
        plan.unchanged,
        sum(sizes[p] for p, _ in download),
    )


def _make_folders_and_links(listing: RemoteListing, plan: PullPlan, dest: Path) -> None:
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


def _download(
    transport: Transport, layout: RemoteLayout, remote: str, plan: PullPlan, writer: _PullWriter
) -> None:
    """Stream the planned files from the cluster into ``writer``; a failed or short stream raises."""
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
