"""A snapshot: prepared locally (listing, size guard, provenance), then shipped to the cluster.

The snapshot is a git commit (rv.files.packs builds it in rv's own repository on this machine) and
the cluster's store is a git repository (rv.agent.store). Shipping costs one round trip when the
store is known to hold the snapshot (it checks the commit is whole and says what is missing if not)
or holds a snapshot this one can be sent against: the new objects then go with the first call, as
one thin pack. Otherwise the first call carries the commit and its trees, the store answers which
blobs it lacks, and a second call sends those. make_snapshot starts the cluster side while the
files are listed; the provenance's ``git diff`` runs while the packs travel (it follows them).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.agent import manifest
from rv.errors import RemoteError, UsageError
from rv.files.link import LinkRate, Meter
from rv.files.packs import LocalStore, Sends, open_local_store
from rv.files.progress import Progress, ProgressCounter
from rv.files.tmpdirs import sweep_once, temp_dir
from rv.layout import RemoteLayout

if TYPE_CHECKING:
    from rv.files.treecache import StoreCache, TreeCache
    from rv.remote.transport import Transport

from rv.files.listing import LARGE_FLOOR, Git, LocalTree, Soon, scan_tree
from rv.files.provenance import project_key, provenance
from rv.remote.agent_client import call_agent, frame
from rv.units import human_size

DEFAULT_MAX_FILE_SIZE = 100 * 1000 * 1000  # 100 MB

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
    remote_path: str  # <root>/store.git: the git store holding it (see ref and snapshot_commit)
    meta_path: str  # <root>/snapshots/<id>.json: provenance, and when it was last used
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
    sent_bytes: int  # everything written to the connection (packs, framing, provenance)
    created: bool  # False: the identical tree was already there
    provenance: dict[str, Any]  # the diff of a dirty tree is in the meta file, not here
    warnings: tuple[str, ...] = ()
    base: str | None = None  # (layers of the store before git; always None now)
    ignored: tuple[tuple[str, int], ...] = ()  # what .rvignore left out: (path, size; -1 a folder)
    snapshot_commit: str = ""  # the git commit holding the files, in the store as ref below
    ref: str = ""


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
    sweep_once()  # what a killed rv left in the temporary folder: its folders' names say whose
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
        parts.append(f"{objects} sent" if sent else f"{objects} to send")
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


READ_AHEAD_MIN_BYTES = 1 << 20  # packs bigger than this are made on a thread ahead of the connection


@dataclass(frozen=True)
class _Call:
    """One snap-put: the packs it carries (``packs``: a pack stream follows the header, maybe of no
    pack), and whether it may set the snapshot's ref (``build``: the provenance follows)."""

    sends: Sends
    packs: bool
    build: bool


@dataclass
class _Shipping:
    """One upload's state across its calls (snap-put; rv.agent.store says what each reply means)."""

    transport: Transport
    layout: RemoteLayout
    snap: LocalSnapshot
    store: StoreCache | None
    local: LocalStore
    commit: str
    on_progress: Progress | None = None
    link: LinkRate | None = None  # the rate measured to the cluster (rv.files.link), kept per store
    sent: list[int] = field(default_factory=lambda: [0])
    _everything: Sends | None = None
    _provenance: Soon | None = None

    def first(self) -> _Call:
        """Nothing when the store is known to hold the snapshot; the new objects, thin, when it holds
        one this can be sent against; else the commit and its trees (the store says what it lacks)."""
        known = self.store.commits(self.snap.project) if self.store else []
        if self.snap.id in {sid for sid, _c in known}:
            return _Call(Sends(), packs=False, build=False)
        self.start_provenance()
        if known:
            sends = self.local.objects(self.commit, [c for _sid, c in known], self._sizes())
            if sends.bases:
                return _Call(sends, packs=True, build=True)
        return _Call(Sends(structure=list(self.everything().structure)), packs=True, build=True)

    def _sizes(self) -> dict[str, int]:
        """Blob sizes by id: the changed rows when the listing knows them, else the whole manifest."""
        tree = self.snap.tree
        if tree.previous is not None and len(tree.previous[1]) < tree.files // 2:
            rows = [r for r in tree.previous[1].values() if r is not None]
            sizes = {r[2]: r[3] for r in rows}
            # A blob the changes do not name can only be new if the base is not the last listing's.
            return _SizesOr(sizes, tree.manifest)
        return {r[2]: r[3] for r in manifest.manifest_rows(tree.manifest)}

    def everything(self) -> Sends:
        """Every object of the snapshot: its commit and trees, and its blobs (listed once)."""
        if self._everything is None:
            rows = manifest.manifest_rows(self.snap.tree.manifest)
            self._everything = self.local.everything(self.commit, rows)
        return self._everything

    def missing(self, oids: list[str]) -> Sends:
        """What to send for the objects the store says it lacks: blobs as they are; a tree with the
        trees under it (the store cannot see what is under a tree it lacks; it says so next time);
        the commit with every tree."""
        full = self.everything()
        blobs = {o.oid: o for o in full.blobs}
        structure = {o.oid: o for o in full.structure}
        unknown = [o for o in oids if o not in blobs and o not in structure]
        if unknown:
            raise RemoteError(
                f"the cluster's store asked for {unknown[0]}, which snapshot {self.snap.id} does not hold"
            )
        want = set(oids)
        sends = Sends(blobs=[blobs[o] for o in dict.fromkeys(oids) if o in blobs])
        if self.commit in want:
            sends.structure = list(full.structure)
        else:
            roots = [o.path for o in full.structure if o.oid in want]
            sends.structure = [
                o for o in full.structure if o.oid != self.commit and any(_under(o.path, r) for r in roots)
            ]
        return sends

    def header(self, call: _Call) -> bytes:
        tree = self.snap.tree
        fields = {"id": self.snap.id, "commit": self.commit, "files": tree.files, "bytes": tree.total_size}
        return frame({**fields, "packs": call.packs, "build": call.build})

    def start_provenance(self) -> None:
        """Start ``git diff`` for the provenance: it runs while the packs travel."""
        if self._provenance is None:
            snap = self.snap
            args = (snap.tree, snap.project, snap.subdir, snap.git)
            self._provenance = Soon(provenance, *args, cache=snap.texts)

    def provenance(self) -> dict[str, Any]:
        self.start_provenance()
        assert self._provenance is not None
        return dict(self._provenance.result())

    def stream(self, call: _Call, progress: ProgressCounter | None) -> Iterator[bytes]:
        """The call's stdin: header, packs, and (to build) the provenance after them."""
        header = self.header(call)
        self.sent[0] += len(header)
        yield header
        if call.packs:
            rate = self.link.read() if self.link is not None else None
            meter = Meter()  # the link's rate: the time the connection spends taking each chunk
            # The packs still to make follow what the meter has measured of the link so far.
            chunks = self.local.stream(self.commit, call.sends, progress, rate, meter.rate)
            for chunk in _read_ahead(chunks) if call.sends.blob_bytes > READ_AHEAD_MIN_BYTES else chunks:
                self.sent[0] += len(chunk)
                start = time.perf_counter()
                yield chunk
                meter.add(len(chunk), time.perf_counter() - start)
            meter.keep(self.link)
        if call.build:
            trailer = frame({"provenance": self.provenance()})
            self.sent[0] += len(trailer)
            yield trailer

    def call(self, call: _Call, progress: ProgressCounter | None = None) -> dict[str, Any]:
        return call_agent(
            self.transport, "snap-put", self.layout.agent_args(), stdin=self.stream(call, progress)
        )


class _SizesOr(dict):  # type: ignore[type-arg]
    """Sizes by blob id from a few rows, falling back to the whole manifest for an id they lack."""

    def __init__(self, sizes: dict[str, int], text: bytes) -> None:
        super().__init__(sizes)
        self.text = text
        self.parsed = False

    def _all(self) -> None:
        if not self.parsed:
            self.parsed = True
            self.update({r[2]: r[3] for r in manifest.manifest_rows(self.text)})

    def __contains__(self, oid: object) -> bool:
        if dict.__contains__(self, oid):
            return True
        self._all()
        return dict.__contains__(self, oid)

    def __getitem__(self, oid: str) -> int:
        if not dict.__contains__(self, oid):
            self._all()
        return int(dict.__getitem__(self, oid))


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + "/")


def _progress(on_progress: Progress | None, sends: Sends) -> ProgressCounter | None:
    if on_progress is None or not sends.blobs:
        return None
    return ProgressCounter(on_progress, "upload", len(sends.blobs), sends.blob_bytes)


def upload_snapshot(
    transport: Transport,
    layout: RemoteLayout,
    snap: LocalSnapshot,
    *,
    cache: StoreCache | None = None,
    cache_dir: Path | None = None,
    on_summary: Callable[[str], None] | None = None,
    on_progress: Progress | None = None,
    _first: tuple[_Shipping, _Call, dict[str, Any]] | None = None,
    held: str | None = None,
) -> SnapshotResult:
    """Make ``snap`` exist on the cluster: one round trip when the store holds it, or holds a snapshot
    it can be sent against (the new objects go with the call); two otherwise (the commit and trees,
    then the blobs the store lacks); more only to mend a store that lost objects.

    ``cache`` (rv.files.treecache.StoreCache) remembers which snapshots the store holds.
    ``cache_dir`` holds rv's own git repository for the work tree (the cache's folder when ``cache``
    is given, else a temporary one): kept, its index makes the next snapshot's commit cheap, and it
    is where ``rv diff`` and ``rv checkout`` find the snapshots this machine sent.
    (``_first``: the shipping, its first call and that call's reply, when make_snapshot made them.)
    ``held``: the commit the store said, in the run's check, it holds whole under this snapshot's
    ref: when this machine would only ask whether it is there, and its commit is that one, no call
    is made at all.
    """
    if cache_dir is None and cache is not None:
        cache_dir = cache.directory
    with contextlib.ExitStack() as stack:
        if _first is None:
            ship = _shipping(transport, layout, snap, cache, cache_dir, on_progress, stack)
            call = ship.first()
            if held is not None and not (call.packs or call.build) and ship.commit == held:
                reply = {"status": "exists"}
            else:
                reply = ship.call(call, _progress(on_progress, call.sends))
        else:
            ship, call, reply = _first
        return _finish_upload(ship, call, reply, on_summary, on_progress)


def _shipping(
    transport: Transport,
    layout: RemoteLayout,
    snap: LocalSnapshot,
    cache: StoreCache | None,
    cache_dir: Path | None,
    on_progress: Progress | None,
    stack: contextlib.ExitStack,
) -> _Shipping:
    """Build the snapshot's commit in rv's repository (a temporary one without a cache folder)."""
    folder = cache_dir if cache_dir is not None else Path(stack.enter_context(temp_dir("git")))
    local = open_local_store(folder, snap.tree, snap.git)
    commit = local.build(snap.tree, snap.texts)
    link = LinkRate(cache.directory, cache.key) if cache is not None else None
    return _Shipping(transport, layout, snap, cache, local, commit, on_progress, link)


def _finish_upload(
    ship: _Shipping,
    call: _Call,
    reply: dict[str, Any],
    on_summary: Callable[[str], None] | None,
    on_progress: Progress | None,
) -> SnapshotResult:
    snap, cache = ship.snap, ship.store
    new_objects = new_bytes = 0
    summary = None
    for _attempt in range(5):
        status = reply["status"]
        if status != "bad-pack":
            new_objects += len(call.sends.blobs)
            new_bytes += call.sends.blob_bytes
        if status in ("exists", "created"):
            break
        if status == "bad-pack":
            if not call.sends.thin:
                raise RemoteError(
                    f"the cluster's store refused a pack of snapshot {snap.id}: {reply.get('refused')}"
                )
            # A thin pack whose bases the store no longer holds (rv gc, a purge): send whole objects.
            if cache is not None:
                cache.forget(snap.project)
            call = _Call(Sends(structure=list(ship.everything().structure)), packs=True, build=True)
        else:
            sends = ship.missing(list(reply["missing"]))
            if sends.blobs and summary is None and on_summary:
                summary = summary_line(snap, new_objects + len(sends.blobs), new_bytes + sends.blob_bytes)
                on_summary(summary)
            call = _Call(sends, packs=bool(sends), build=True)
        reply = ship.call(call, _progress(on_progress, call.sends))
    else:
        raise RemoteError(
            f"snapshot {snap.id} could not be completed on the cluster (its objects kept disappearing)",
            hint="is `rv gc` running in a loop, or the store's filesystem purging files? retry in a minute",
        )
    created = status == "created"
    if summary is None:
        sent = new_objects > 0 or created
        summary = summary_line(snap, new_objects if sent else None, new_bytes, sent=True)
        if on_summary:
            on_summary(summary)
    if cache is not None:
        cache.add(snap.project, snap.id, ship.commit)
        ship.local.remember(snap.id, ship.commit)
        ship.local.tidy()
    return SnapshotResult(
        id=snap.id,
        remote_path=ship.layout.store,
        meta_path=ship.layout.snapshot_meta(snap.id),
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
        ignored=snap.tree.ignored,
        snapshot_commit=ship.commit,
        ref=ship.layout.snapshot_ref(snap.id),
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
    start-up (most of a round trip on many clusters) overlap with it and with building the commit:
    a resubmit with nothing or little changed costs about one round trip in all. Local errors (a
    file over the size limit) still win: the early command then reads an empty input and exits,
    with nothing sent. For a strict "check everything, then connect" order, call prepare_snapshot
    and upload_snapshot yourself. ``on_prepared`` sees the local snapshot (its warnings, say)
    before anything is sent.
    """
    store = None
    if cache_dir is not None:
        from rv.files.treecache import StoreCache

        store = StoreCache(cache_dir, cache_key or layout.root)
    ready = threading.Event()
    first: list[tuple[_Shipping, _Call] | None] = []

    def first_stdin() -> Iterator[bytes]:
        ready.wait()
        if first[0] is not None:
            ship, call = first[0]
            yield from ship.stream(call, _progress(on_progress, call.sends))

    with contextlib.ExitStack() as stack:
        early = Soon(call_agent, transport, "snap-put", layout.agent_args(), stdin=first_stdin())
        try:
            snap = prepare_snapshot(
                path, max_file_size=max_file_size, allow_large=allow_large, git=git, cache_dir=cache_dir
            )
            if on_prepared:
                on_prepared(snap)
            ship = _shipping(transport, layout, snap, store, cache_dir, on_progress, stack)
            call = ship.first()
        except BaseException:
            first.append(None)  # the early command reads an empty stdin and exits
            ready.set()
            with contextlib.suppress(Exception):
                early.result()
            raise
        first.append((ship, call))
        ready.set()
        reply = early.result()
        return _finish_upload(ship, call, reply, on_summary, on_progress)
