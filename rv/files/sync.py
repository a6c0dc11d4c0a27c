"""Push and watch (pull is :mod:`rv.files.pull`): plans are pure functions, applying them is one round trip.

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

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rv.agent import manifest
from rv.errors import NotFound, RemoteError, UsageError
from rv.files.listing import MODE_EXEC, Entry, Git, LocalTree, blob_id, ignored_paths, scan_tree
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
    "PushPlan",
    "PushResult",
    "RemoteEntry",
    "RemoteListing",
    "blob_id",
    "parse_size",
    "plan_push",
    "push",
    "scan_remote",
    "tree_id",
    "watch",
]
