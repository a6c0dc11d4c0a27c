"""A snapshot: prepared locally (listing, size guard, provenance), then shipped to the cluster.

Shipping (see :mod:`rv.agent.store` for the cluster side) costs one round trip when the snapshot
already exists and usually one when it does not: the manifest travels as the changes since a
snapshot this machine knows the store holds, with the new files (up to SPECULATE_BYTES) sent
unasked; when more is missing, ``snap-put`` streams only those objects and the tree (or a layer over
a full tree) is built by hard links. make_snapshot starts the cluster side while the files are
listed; the provenance's ``git diff`` runs while the manifest and objects travel (it follows them);
the files are read on a thread of their own while the connection sends.
"""

from __future__ import annotations

import contextlib
import os
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.agent import manifest
from rv.errors import RemoteError, UsageError
from rv.files.progress import Progress, ProgressCounter
from rv.layout import RemoteLayout

if TYPE_CHECKING:
    from rv.files.treecache import StoreCache, TreeCache
    from rv.remote.transport import Transport

from rv.files.listing import LARGE_FLOOR, READ_CHUNK, Entry, Git, LocalTree, Soon, scan_tree
from rv.files.provenance import project_key, provenance
from rv.remote.agent_client import call_agent, frame
from rv.units import human_size

DEFAULT_MAX_FILE_SIZE = 100 * 1000 * 1000  # 100 MB

# --------------------------------------------------------------------------------------------------
# The manifest on the wire: a delta against a snapshot the store is known to hold


def diff_manifests(old: bytes, new: bytes) -> tuple[list[list[Any]], list[str]]:
    """(rows new or changed, paths gone) from manifest ``old`` to ``new``: set operations in C."""
    a, b = set(old.split(b"\n")), set(new.split(b"\n"))
    upsert = [manifest.parse_line(line) for line in b - a if line]
    have = {r[0] for r in upsert}
    remove = [p for p in (manifest.parse_line(line)[0] for line in a - b if line) if p not in have]
    return upsert, remove


def manifest_payload(tree: LocalTree, known: Sequence[str], texts: TreeCache | None = None) -> dict[str, Any]:
    """The manifest to send: changes to a snapshot ``known`` to be in the store, else the full list.

    The changes since the last listing are at hand when that listing was sent to this store (the
    usual resubmit); otherwise they come from comparing with a known snapshot's cached manifest.
    The cluster checks the result against the snapshot id and asks for the full list on a mismatch.
    """
    if tree.id in known:
        return {"base": tree.id, "upsert": [], "remove": []}
    delta = None
    if tree.previous is not None and tree.previous[0] in known:
        changes = tree.previous[1]
        delta = (tree.previous[0], [r for r in changes.values() if r is not None],
                 [p for p, r in changes.items() if r is None])  # fmt: skip
    elif texts is not None:
        for sid in known:
            old = texts.text(sid)
            if old is not None:
                delta = (sid, *diff_manifests(old, tree.manifest))
                break
    if delta is not None and len(delta[1]) + len(delta[2]) < max(1, tree.files // 2):
        return {"base": delta[0], "upsert": delta[1], "remove": delta[2]}
    return full_payload(tree)


def full_payload(tree: LocalTree) -> dict[str, Any]:
    """The whole manifest as its text: the cluster hashes and parses it in C, nothing re-encoded."""
    return {"text": tree.manifest.decode("ascii")}


def payload_rows(payload: dict[str, Any]) -> list[list[Any]]:
    """The rows a payload may need objects for: a delta's new rows, or every row of a full list."""
    if "text" in payload:
        return list(manifest.manifest_rows(payload["text"].encode("ascii")))
    return list(payload.get("upsert", payload.get("entries", [])))


# --------------------------------------------------------------------------------------------------
# Snapshots


@dataclass(frozen=True)
class LocalSnapshot:
    """Everything about a snapshot that is known before touching the network."""

    tree: LocalTree
    id: str
    project: str
    subdir: str  # the folder asked for, relative to the repo top ("" when it is the top)
    provenance: dict[str, Any]  # without the diff: see provenance(with_diff=False)
    allowed_large: tuple[tuple[str, int], ...] = ()
    git: Git = field(default_factory=Git, compare=False, repr=False)
    texts: TreeCache | None = field(default=None, compare=False, repr=False)  # cached manifests

    @property
    def branch(self) -> str | None:
        return self.tree.repo.branch if self.tree.repo else None

    @property
    def commit(self) -> str | None:
        return self.tree.repo.commit if self.tree.repo else None

    @property
    def dirty(self) -> bool:
        return bool(self.tree.repo and self.tree.repo.dirty)


@dataclass(frozen=True)
class SnapshotResult:
    id: str
    remote_path: str  # <root>/snapshots/<id>: the read-only tree; <id>.layer for a layer (see base)
    meta_path: str  # <root>/snapshots/<id>.json: provenance (and a layer's rows)
    project: str
    branch: str | None
    commit: str | None
    dirty: bool
    subdir: str  # cd here inside the snapshot to be where `rv run` was typed
    summary: str
    files: int
    total_bytes: int
    new_objects: int
    new_bytes: int
    sent_bytes: int  # everything written to the connection (objects, framing, manifest)
    created: bool  # False: the identical tree was already there
    provenance: dict[str, Any]  # the diff of a dirty tree is in the meta file, not here
    warnings: tuple[str, ...] = ()
    base: str | None = None  # a layer: the full snapshot it sits on (jobs copy that, then the layer)
    ignored: tuple[tuple[str, int], ...] = ()  # what .rvignore left out: (path, size; -1 a folder)


def check_sizes(tree: LocalTree, max_file_size: int, allow_large: bool) -> tuple[tuple[str, int], ...]:
    """Refuse files over the limit (naming them) unless allowed; return the large ones allowed."""
    if max_file_size >= LARGE_FLOOR:
        sizes: Iterable[tuple[str, int]] = tree.large  # every file that could be over: no parse
    else:
        sizes = ((e.path, e.size) for e in tree.entries if not e.is_link)
    large = sorted(((p, s) for p, s in sizes if s > max_file_size), key=lambda x: -x[1])
    if large and not allow_large:
        shown = ", ".join(f"{p} ({human_size(s)})" for p, s in large[:5])
        more = f" and {len(large) - 5} more" if len(large) > 5 else ""
        raise UsageError(
            f"{len(large)} file{'s' if len(large) > 1 else ''} over the {human_size(max_file_size)} limit: "
            f"{shown}{more}",
            hint="add them to .rvignore (gitignore syntax), or allow them with --allow-large "
            "(the limit is set with --max-file-size)",
        )
    return tuple(large)


def prepare_snapshot(
    path: str | Path = ".",
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    allow_large: bool = False,
    git: Git | None = None,
    cache_dir: Path | None = None,
) -> LocalSnapshot:
    """List, hash and check the snapshot of ``path``'s repo. Local only: run it before connecting.

    With ``cache_dir`` the last listing of the repo is reused (see scan_tree) and the root commit is
    remembered.
    """
    git = git or Git()
    texts = None
    if cache_dir is not None:
        from rv.files.treecache import TreeCache

        texts = TreeCache(cache_dir)
    tree = scan_tree(path, git=git, cache=texts)
    allowed = check_sizes(tree, max_file_size, allow_large)
    project = project_key(tree, git, cache_dir)
    here = Path(path).resolve()
    subdir = here.relative_to(tree.root).as_posix() if here != tree.root else ""
    prov = provenance(tree, project, subdir, git, with_diff=False)
    return LocalSnapshot(tree, tree.id, project, subdir, prov, allowed, git, texts)


def summary_line(snap: LocalSnapshot, new_objects: int | None, new_bytes: int, *, sent: bool = False) -> str:
    tree = snap.tree
    n = tree.files
    parts = [f"snapshot {snap.id[:12]}: {n:,} file{'s' if n != 1 else ''}, {human_size(tree.total_size)}"]
    if new_objects is None:
        parts.append("already on the cluster, nothing to send")
    else:
        objects = f"{new_objects:,} new object{'s' if new_objects != 1 else ''} ({human_size(new_bytes)})"
        parts.append(f"{objects} sent with the manifest" if sent else f"{objects} to send")
    files = [s for _, s in tree.ignored if s >= 0]
    folders = sum(1 for _, s in tree.ignored if s < 0)
    if tree.ignored:
        what = []
        if files:
            what.append(f"{len(files):,} file{'s' if len(files) != 1 else ''} ({human_size(sum(files))})")
        if folders:
            what.append(f"{folders:,} folder{'s' if folders != 1 else ''}")
        parts.append(".rvignore left out " + " and ".join(what))
    else:
        parts.append(".rvignore left out nothing")
    if snap.allowed_large:
        parts.append(f"{len(snap.allowed_large)} file(s) over the size limit allowed")
    return "; ".join(parts)


def snapshot_warnings(snap: LocalSnapshot) -> list[str]:
    """What the user should hear before a snapshot is sent (on stderr, by `rv run` too).

    The tree's own warnings (not a repository, a submodule not checked out, a file that is neither
    regular nor a link), files over the size limit sent anyway, and uncommitted changes: the run is
    recorded as the commit plus a diff, which is easy to miss later.
    """
    out = list(snap.tree.warnings)
    if snap.allowed_large:
        shown = ", ".join(f"{p} ({human_size(n)})" for p, n in snap.allowed_large[:5])
        more = f" and {len(snap.allowed_large) - 5} more" if len(snap.allowed_large) > 5 else ""
        out.append(
            f"sending {len(snap.allowed_large)} file(s) over the size limit (--allow-large): {shown}{more}"
        )
    repo = snap.tree.repo
    if repo is not None and repo.dirty:
        parts = []
        if repo.untracked:
            names = ", ".join(repo.untracked[:3]) + (
                f" and {len(repo.untracked) - 3} more" if len(repo.untracked) > 3 else ""
            )
            parts.append(f"untracked: {names}")
        detail = f" ({'; '.join(parts)})" if parts else ""
        if repo.commit:
            at = f"{repo.branch or 'detached HEAD'}@{repo.commit[:7]}+"
            out.append(
                f"the snapshot holds uncommitted changes{detail}: the run is recorded as {at} with their "
                "diff (commit first to reproduce it from git alone)"
            )
        else:
            out.append(f"the repository has no commit yet{detail}: the run records no commit")
    return out


def _object_stream(
    root: Path,
    header: bytes,
    sends: list[Entry],
    progress: ProgressCounter | None,
    counter: list[int],
) -> Iterator[bytes]:
    """``header``, then ``O <oid> <size> <content>`` per object, then ``E``, in ~1 MiB chunks.

    Progress counts an object's bytes as they are handed to the connection.
    """
    buf = bytearray(header)
    for e in sends:
        buf += b"O" + bytes.fromhex(e.oid) + struct.pack(">Q", e.size)
        full = os.path.join(root, e.path)
        if e.is_link:
            data = os.fsencode(os.readlink(full)) if os.path.islink(full) else b""
            buf += data[: e.size].ljust(e.size, b"\0")
            if progress:
                progress.add(e.size)
        else:
            left = e.size
            try:
                fd = os.open(full, os.O_RDONLY)  # a bare descriptor: no file object per small file
            except OSError:
                fd = -1
            try:
                while left:
                    data = os.read(fd, min(READ_CHUNK, left)) if fd >= 0 else b""
                    if not data:
                        # Gone or shrunk since it was hashed: keep the frame's length; the cluster
                        # will find the id wrong and refuse the object.
                        data = b"\0" * min(READ_CHUNK, left)
                    buf += data
                    left -= len(data)
                    if len(buf) >= READ_CHUNK:
                        counter[0] += len(buf)
                        yield bytes(buf)
                        buf.clear()
                    if progress:
                        progress.add(len(data))
            finally:
                if fd >= 0:
                    os.close(fd)
        if progress:
            progress.add(files=1)
        if len(buf) >= READ_CHUNK:
            counter[0] += len(buf)
            yield bytes(buf)
            buf.clear()
    buf += b"E"
    counter[0] += len(buf)
    yield bytes(buf)
    if progress:
        progress.done()


_END = object()

READ_AHEAD_MIN = 16  # objects to send before a thread reads them ahead of the connection


def _read_ahead(chunks: Iterator[bytes], depth: int = 8) -> Iterator[bytes]:
    """``chunks``, made on a thread of their own up to ``depth`` ahead of the one sending them.

    The connection encrypts and sends on the caller's thread; reading the files (page cache copies,
    outside the GIL) then overlaps with it. Closing this generator stops the reader.
    """
    ready: queue.Queue[Any] = queue.Queue(depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for chunk in chunks:
                if not put(chunk):
                    return
            put(_END)
        except BaseException as exc:  # handed to the sending side below, never dropped
            put(exc)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    reader = threading.Thread(target=produce, daemon=True, name="rv-read-ahead")
    reader.start()
    try:
        while True:
            item = ready.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


# New objects of a delta go with the first call, unasked, up to this much: cheaper than a round
# trip to ask (the cluster reads past any it has already). A branch switch or a formatter run
# touches hundreds of files; their bytes are new to the store unless the same content was sent
# before, so what this can waste is bounded by these figures, while asking first always costs a
# second agent start and round trip (and the manifest sent twice).
SPECULATE_BYTES = 16 << 20
SPECULATE_FILES = 4096


def _speculative(payload: dict[str, Any]) -> list[Entry]:
    """The objects of a delta's new rows, when they are few and small (a full list asks first)."""
    rows = payload.get("upsert", [])
    by_oid = {r[2]: Entry(*r) for r in rows}
    if len(by_oid) > SPECULATE_FILES or sum(e.size for e in by_oid.values()) > SPECULATE_BYTES:
        return []
    return list(by_oid.values())


@dataclass
class _Shipping:
    """One upload's state across its calls (snap-put; rv.agent.store says what each reply means)."""

    transport: Transport
    layout: RemoteLayout
    snap: LocalSnapshot
    store: StoreCache | None
    on_progress: Progress | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    sent: list[int] = field(default_factory=lambda: [0])
    known: list[str] = field(default_factory=list)
    _provenance: Soon | None = None

    def first(self) -> tuple[bytes, list[Entry], bool]:
        """The first call's header, the objects that go with it unasked, and whether it builds."""
        self.known = self.store.known(self.snap.project) if self.store else []
        self.payload = manifest_payload(self.snap.tree, self.known, self.snap.texts)
        build = self.snap.id not in self.known  # probably new: let it be built in this call
        if build:
            self.start_provenance()
        header = frame({"id": self.snap.id, **self.payload, "build": build})
        return header, _speculative(self.payload) if build else [], build

    def start_provenance(self) -> None:
        """Start ``git diff`` for the provenance: it runs while the manifest and objects travel."""
        if self._provenance is None:
            snap = self.snap
            args = (snap.tree, snap.project, snap.subdir, snap.git)
            self._provenance = Soon(provenance, *args, cache=snap.texts)

    def provenance(self) -> dict[str, Any]:
        self.start_provenance()
        assert self._provenance is not None
        return dict(self._provenance.result())

    def stream(
        self, header: bytes, sends: list[Entry], progress: ProgressCounter | None, build: bool
    ) -> Iterator[bytes]:
        """The call's stdin: header, objects, and (to build) the provenance after them."""
        chunks = _object_stream(self.snap.tree.root, header, sends, progress, self.sent)
        # A thread to read ahead pays only with more than a few files to read.
        yield from _read_ahead(chunks) if len(sends) > READ_AHEAD_MIN else chunks
        if build:
            trailer = frame({"provenance": self.provenance()})
            self.sent[0] += len(trailer)
            yield trailer

    def call(self, sends: list[Entry], progress: ProgressCounter | None = None) -> dict[str, Any]:
        header = frame({"id": self.snap.id, **self.payload, "build": True})
        stdin = self.stream(header, sends, progress, True)
        return call_agent(self.transport, "snap-put", self.layout.agent_args(), stdin=stdin)


def upload_snapshot(
    transport: Transport,
    layout: RemoteLayout,
    snap: LocalSnapshot,
    *,
    cache: StoreCache | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    _first: tuple[_Shipping, list[Entry], dict[str, Any]] | None = None,
) -> SnapshotResult:
    """Make ``snap`` exist on the cluster: one round trip when it does already or differs from a
    snapshot known to be there by a few small files (sent along unasked), two otherwise.

    ``cache`` (rv.files.treecache.StoreCache) remembers which snapshots the store holds: the manifest then
    travels as a delta against one of them. (``_first``: the shipping, the objects sent with its
    first call and that call's reply, when make_snapshot made it already.)
    """
    if _first is None:
        ship = _Shipping(transport, layout, snap, cache, on_progress)
        header, spec, build = ship.first()
        stdin = ship.stream(header, spec, None, build)
        reply = call_agent(transport, "snap-put", layout.agent_args(), stdin=stdin)
    else:
        ship, spec, reply = _first
    new_objects = new_bytes = 0
    summary = None
    for _attempt in range(4):
        new_objects += int(reply.get("received", 0))
        new_bytes += int(reply.get("received_bytes", 0))
        if reply.get("bad"):
            bad = set(reply["bad"])
            paths = sorted(e.path for e in spec if e.oid in bad) or sorted(reply["bad"])
            raise RemoteError(
                f"{len(paths)} file(s) changed while being sent: {', '.join(paths[:5])}",
                hint="rerun once they stop changing (or .rvignore files a running program writes)",
            )
        status = reply["status"]
        if status in ("exists", "created"):
            break
        if status == "need-full":
            # The base is gone from the store (rv gc) or is not what this machine remembers.
            if cache is not None and "base" in ship.payload:
                cache.forget(snap.project, ship.payload["base"])
            ship.payload = full_payload(snap.tree)
            spec = []
            reply = ship.call([])
            continue
        missing = list(reply["missing"])
        by_oid = {r[2]: r for r in payload_rows(ship.payload)}
        if any(o not in by_oid for o in missing):
            by_oid = {r[2]: r for r in manifest.manifest_rows(snap.tree.manifest)}
        spec = [Entry(*by_oid[o]) for o in missing]
        if summary is None and on_summary:
            summary = summary_line(snap, new_objects + len(spec), new_bytes + sum(e.size for e in spec))
            on_summary(summary)
        progress = ProgressCounter(on_progress, "upload", len(spec), sum(e.size for e in spec))
        reply = ship.call(spec, progress)
    else:
        raise RemoteError(
            f"snapshot {snap.id} could not be completed on the cluster (objects kept disappearing)",
            hint="is `rv gc` running in a loop? retry in a minute",
        )
    created = status == "created"
    if summary is None:
        summary = summary_line(snap, new_objects if created else None, new_bytes, sent=True)
        if on_summary:
            on_summary(summary)
    if cache is not None:
        cache.add(snap.project, snap.id)
    base = reply.get("base")
    return SnapshotResult(
        id=snap.id,
        remote_path=layout.snapshot_layer(snap.id) if base else layout.snapshot(snap.id),
        meta_path=layout.snapshot_meta(snap.id),
        project=snap.project,
        branch=snap.branch,
        commit=snap.commit,
        dirty=snap.dirty,
        subdir=snap.subdir,
        summary=summary,
        files=snap.tree.files,
        total_bytes=snap.tree.total_size,
        new_objects=new_objects,
        new_bytes=new_bytes,
        sent_bytes=ship.sent[0],
        created=created,
        provenance=snap.provenance,
        warnings=snap.tree.warnings,
        base=base,
        ignored=snap.tree.ignored,
    )


def make_snapshot(
    transport: Transport,
    layout: RemoteLayout,
    path: str | Path = ".",
    *,
    max_file_size: int = DEFAULT_MAX_FILE_SIZE,
    allow_large: bool = False,
    cache_dir: Path | None = None,
    cache_key: str | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    on_prepared: Callable[[LocalSnapshot], None] | None = None,
    git: Git | None = None,
) -> SnapshotResult:
    """List, hash, check and ship the snapshot of ``path``'s repo; ``cache_key`` names the store.

    The first remote command starts before the local listing, so the cluster's shell and python
    start-up (most of a round trip on many clusters) overlap with it: a resubmit with nothing or
    little changed costs about one round trip in all. Local errors (a file over the size limit) still
    win: the early command then reads an empty input and exits, with nothing sent. For a strict
    "check everything, then connect" order, call prepare_snapshot and upload_snapshot yourself.
    ``on_prepared`` sees the local snapshot (its warnings, say) before anything is sent.
    """
    store = None
    if cache_dir is not None:
        from rv.files.treecache import StoreCache

        store = StoreCache(cache_dir, cache_key or layout.root)
    ready = threading.Event()
    first: list[tuple[bytes, list[Entry], bool] | None] = []
    ship: _Shipping | None = None

    def first_stdin() -> Iterator[bytes]:
        ready.wait()
        if first[0] is not None:
            assert ship is not None
            yield from ship.stream(*first[0][:2], None, first[0][2])

    early = Soon(call_agent, transport, "snap-put", layout.agent_args(), stdin=first_stdin())
    try:
        snap = prepare_snapshot(
            path, max_file_size=max_file_size, allow_large=allow_large, git=git, cache_dir=cache_dir
        )
        if on_prepared:
            on_prepared(snap)
        ship = _Shipping(transport, layout, snap, store, on_progress)
        header, spec, build = ship.first()
    except BaseException:
        first.append(None)  # the early command reads an empty stdin and exits
        ready.set()
        with contextlib.suppress(Exception):
            early.result()
        raise
    first.append((header, spec, build))
    ready.set()
    reply = early.result()
    return upload_snapshot(
        transport, layout, snap, cache=store, on_summary=on_summary, on_progress=on_progress,
        _first=(ship, spec, reply),
    )  # fmt: skip
