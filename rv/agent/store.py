"""The snapshot store: content-addressed objects, snapshots made of them, layers over snapshots.

Modes: ``snap-query`` (does ``snapshots/<id>`` exist? if not, which of its objects are missing; the
id and manifest come on stdin, so the command can start before they are known) and ``snap-put``
(receive objects, then build ``snapshots/<id>``). :func:`collect_garbage` is the store's half of
``rv gc``.

Rules every mode keeps:

* An object's name is the git blob id of its content, checked on arrival; it is written under
  ``tmp/`` and renamed into ``objects/`` only when complete and correct, so an interrupted upload
  never leaves a bad object (and the partial temp file is removed when stdin ends early).
* ``snapshots/<id>`` appears by one rename of a fully built tree, so it exists only when complete.
* gc takes the store lock exclusively; uploads and queries hold it shared.
* Objects are 0400, executables 0500, snapshot folders 0500 (masked by the client's umask).
"""

import contextlib
import errno
import functools
import json
import os
import queue
import re
import shutil
import struct
import threading
import time

from rv.agent import common, layout, locks, manifest

VERSION = 1

STALE_BUILD_S = 86400


def object_path(root, oid):
    return common.under(root, layout.object_file(oid))


def clean_stale_temps(root):
    tmpdir = common.under(root, layout.TMP)
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(tmpdir):
            if name.startswith(b".rv-tmp-"):
                p = common.join(tmpdir, name)
                with contextlib.suppress(OSError):
                    if now - os.lstat(p).st_mtime > common.TMP_STALE_S:
                        os.unlink(p)


LAYER_MIN = 256

LAYER_SHARE = 16

LAYER_DEPTH = 8

CHAIN_BROKEN = 4 * LAYER_DEPTH  # more links than this: a loop or a damaged store (jobs check it too)


def snapshot_dir(root, sid):
    if not re.match(r"^[0-9a-f]{24}$", sid):
        raise common.AgentError("bad snapshot id %r" % sid, "usage")
    return common.under(root, layout.snapshot(sid))


def snapshot_exists(root, sid):
    path = snapshot_dir(root, sid)
    return os.path.isdir(path) or os.path.isdir(common.under(root, layout.snapshot_layer(sid)))


def read_meta(root, sid):
    with open(common.under(root, layout.snapshot_meta(sid)), "rb") as fh:
        return json.loads(fh.read().decode("ascii"))


def read_manifest(root, sid):
    with open(common.under(root, layout.snapshot_manifest(sid)), "rb") as fh:
        return fh.read()


def layer_changes(layer):
    changes = dict((p, None) for p in layer.get("remove", ()))
    for row in layer.get("upsert", ()):
        changes[row[0]] = row
    return changes


def load_snapshot(root, sid, meta=None):
    """A stored snapshot's manifest and meta, ``(text, meta)``.

    Raises OSError, ValueError or KeyError when it is not there or not readable as such (rv 0.1's
    included).
    """
    meta = meta if meta is not None else read_meta(root, sid)
    if meta.get("version") not in (2, 3) or not snapshot_exists(root, sid):
        raise ValueError("snapshot %s cannot be a base" % sid)
    try:
        text = read_manifest(root, sid)
    except FileNotFoundError:
        if meta.get("base") is None or meta.get("version") != 2:
            raise
        text = manifest.splice(read_manifest(root, meta["base"]), layer_changes(meta["layer"]))[0]
    # A damaged copy only costs time: the snapshot id the client asks for is checked against the
    # text spliced from this one, and a mismatch asks the client for the full list.
    return text, meta


def layer_chain(root, sid, meta):
    """``[(id, meta), ...]`` from snapshot ``sid`` down to the full snapshot it rests on, that one
    last. Raises OSError, ValueError or KeyError when a link is gone (never by rv's gc, which keeps
    whole chains) or the chain loops."""
    chain = [(sid, meta)]
    while meta.get("base") is not None:
        if len(chain) > CHAIN_BROKEN:
            raise ValueError("snapshot %s: a chain of layers with no end" % chain[0][0])
        sid = meta["base"]
        meta = read_meta(root, sid)
        if not snapshot_exists(root, sid):
            raise ValueError("snapshot %s is gone" % sid)
        chain.append((sid, meta))
    return chain


def chain_changes(chain):
    """``{path: row or None}``: everything the layers of ``chain`` change in its full snapshot.

    Later layers win; rows equal to the full snapshot's may be among them (a file changed, then
    changed back): the caller filters with :func:`layer_over`.
    """
    changes = {}
    for _sid, meta in reversed(chain[:-1]):
        changes.update(layer_changes(meta["layer"]))
    return changes


def check_rows(rows):
    for e in rows:
        if not isinstance(e, list) or len(e) != 4:
            raise common.AgentError("bad manifest entry %r" % (e,), "usage")
        common.check_relpath(e[0])
        if e[1] not in (manifest.MODE_FILE, manifest.MODE_EXEC, manifest.MODE_LINK) or not re.match(
            r"^[0-9a-f]{40}$", e[2]
        ):
            raise common.AgentError("bad manifest entry %r" % (e,), "usage")
        if not isinstance(e[3], int) or e[3] < 0:
            raise common.AgentError("bad manifest entry %r" % (e,), "usage")


def resolve_manifest(root, sid, payload):
    """The manifest the client means: a full list, or changes to a snapshot stored here.

    Returns None when that snapshot is gone or not what the client thought (it then sends the full
    list), else a dict: ``text``, ``files``, ``bytes``, ``new`` (the rows that may need objects:
    with changes to a stored snapshot, only the upserted ones; that snapshot's objects are referenced
    by it, and gc cannot remove them while the caller holds the store lock) and ``over``: None, or
    ``(its chain, its manifest, {path: row or None})``: the changes to it (see :func:`layer_chain`).
    """
    if "text" in payload or "entries" in payload:
        if "text" in payload:
            # The manifest's own text: hashed and parsed in C, never encoded again line by line
            # (a second of Python at 50,000 files). Its rows must come sorted and once each, as
            # manifest_text would write them: later splices find lines by binary search.
            text = payload["text"].encode("ascii")
            rows = manifest.manifest_rows(text)
            check_rows(rows)
            keys = [manifest.enc(r[0]) for r in rows]
            if any(keys[i] >= keys[i + 1] for i in range(len(keys) - 1)):  # (no itertools.pairwise in 3.6)
                raise common.AgentError("the manifest sent is not sorted by path", "usage")
        else:
            rows = payload["entries"]
            check_rows(rows)
            text = manifest.manifest_text(rows)
        if manifest.text_id(text) != sid:
            raise common.AgentError("the manifest sent does not hash to snapshot id %s" % sid, "remote")
        return {"text": text, "files": len(rows), "bytes": sum(r[3] for r in rows), "new": rows, "over": None}
    base_id = payload["base"]
    try:
        base_text, meta = load_snapshot(root, base_id)
        chain = layer_chain(root, base_id, meta)  # a job needs every link: check them now
    except (OSError, ValueError, KeyError, TypeError):
        return None
    upsert = payload.get("upsert", [])
    check_rows(upsert)
    changes = {}
    for path in payload.get("remove", ()):
        changes[common.check_relpath(path)] = None
    for row in upsert:
        changes[row[0]] = row
    text, old = manifest.splice(base_text, changes)
    if manifest.text_id(text) != sid:
        return None  # the client's copy of the base differs from the one here: ask for all
    files = int(meta["files"]) + sum((changes[p] is not None) - (old[p] is not None) for p in changes)
    size = int(meta["bytes"]) + sum(r[3] for r in upsert) - sum(r[3] for r in old.values() if r is not None)
    return {"text": text, "files": files, "bytes": size, "new": upsert, "over": (chain, base_text, changes)}


def missing_objects(root, entries, present=()):
    """``{oid: size}`` of the rows' objects not in the store (``present``: known to be there)."""
    missing = {}
    for _path, _mode, oid, size in entries:
        if oid not in missing and oid not in present and not os.path.exists(object_path(root, oid)):
            missing[oid] = size
    return missing


def touch(path):
    with contextlib.suppress(OSError):
        os.utime(path, None)


def mode_snap_query(args):
    # The id comes on stdin, not in ARGS: the client starts this command (shell and python start-up)
    # while it is still listing and hashing, and writes the header once it knows the id.
    root = common.root_path(args["root"])
    payload = common.read_header()
    sid = payload["id"]
    with locks.store_lock(root, exclusive=False):
        if snapshot_exists(root, sid):
            touch(common.under(root, layout.snapshot_meta(sid)))  # "last used": gc measures age from here
            return {"status": "exists"}
        resolved = resolve_manifest(root, sid, payload)
        if resolved is None:
            return {"status": "need-full"}
        missing = missing_objects(root, resolved["new"])
        return {"status": "missing", "missing": sorted(missing), "bytes": sum(missing.values())}


# Threads that create objects and link snapshot trees: NFS and Lustre clients overlap the metadata
# round trips of creations in flight together, and the syscalls release the GIL. (On the loopback
# cluster's disk, ext4 without a journal, a creation right after mass deletes costs 0.3 ms: the
# allocator skips every recently freed inode, in perf's `recently_deleted`. There 1, 2 and 4
# threads measured alike within the noise, 1 with the least system time.)
WRITERS = 4

POOL_MAX = 1 << 20  # objects up to this size are read whole and handed to a writer thread

LINK_RUN = 256  # rows a writer thread links at a time when a snapshot's tree is built

INLINE_OBJECTS = 16  # the first objects of a call are written by the reading thread itself


class Writers(object):
    """A few threads running jobs; the first error is raised by ``put`` or ``finish``."""

    def __init__(self, n=None):
        n = n or WRITERS
        self.jobs = queue.Queue(n * 8)
        self.errors = []
        self.threads = [threading.Thread(target=self._run) for _ in range(n)]
        for t in self.threads:
            t.daemon = True
            t.start()

    def _run(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.errors:
                continue  # failed already: drain without working
            try:
                job()
            except BaseException as exc:  # handed to the reading thread by put/finish, never dropped
                self.errors.append(exc)

    def put(self, job):
        if self.errors:
            raise self.errors[0]
        self.jobs.put(job)

    def finish(self, check=True):
        """Wait for every job; raise the first error unless ``check`` is false (already failing)."""
        for _ in self.threads:
            self.jobs.put(None)
        for t in self.threads:
            t.join()
        if check and self.errors:
            raise self.errors[0]


def _store_object(tmpdir, fan, dest, oid, data, fans, done):
    """Write ``data`` as a temp file and rename it to ``dest`` if it is the object ``oid``."""
    hasher = manifest.blob_hasher(len(data))
    hasher.update(data)
    if hasher.hexdigest() != oid:
        done.append((oid, -1))  # the local file changed while it was read: never store it
        return
    tmp = common.temp_name(tmpdir, oid)
    common._cleanup.add(tmp)
    renamed = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, common.private(0o444))
        try:
            common.write_all(fd, data)
        finally:
            os.close(fd)
        if fan not in fans:
            common.makedirs(fan)
            fans.add(fan)
        os.rename(tmp, dest)
        renamed = True
        done.append((oid, len(data)))
    finally:
        common._cleanup.discard(tmp)
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _store_streamed(tmpdir, fan, dest, oid, size, fans, done):
    """A large object straight from stdin into a temp file, renamed to ``dest`` when correct."""
    tmp = common.temp_name(tmpdir, oid)
    common._cleanup.add(tmp)
    renamed = False
    try:
        hasher = manifest.blob_hasher(size)
        common.receive_into(tmp, size, hasher, 0o444)
        if hasher.hexdigest() != oid:
            done.append((oid, -1))
            return
        if fan not in fans:
            common.makedirs(fan)
            fans.add(fan)
        os.rename(tmp, dest)
        renamed = True
        done.append((oid, size))
    finally:
        common._cleanup.discard(tmp)
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def receive_objects(root):
    """Read ``O <oid:20> <size:8> <content>`` frames until ``E``; each lands by rename when correct.

    Returns (objects stored, their bytes, ids that did not match their content, ids now present).
    An object already stored is read past, not written again (the client sends small ones without
    asking first). Small objects are written by Writers threads while the next ones are read; each
    is a temp file until it is complete and checked, and a temp file that did not become an object
    is removed (by its writer, or by the exit cleanup when stdin ends early).
    """
    tmpdir = common.under(root, layout.TMP)
    common.makedirs(tmpdir)
    objects = common.under(root, layout.OBJECTS)
    fans = set()  # objects/xx folders known to exist: a failing mkdir per object adds up
    done = []  # (oid, size, or -1 when the content was not the id), appended by the writers
    present = set()
    writers = None  # started at the first object to write: a resubmit sends none, or a few
    try:
        while True:
            tag = common.read_exact(1)
            if tag == b"E":
                break
            if tag != b"O":
                raise common.AgentError("corrupt upload stream (tag %r)" % tag)
            head = common.read_exact(28)
            oid = head[:20].hex()
            (size,) = struct.unpack(">Q", head[20:])
            fan = common.join(objects, oid[:2].encode("ascii"))
            dest = common.join(fan, oid.encode("ascii"))
            if oid in present or os.path.exists(dest):
                skip(size)
                present.add(oid)
                continue
            present.add(oid)  # written now (or refused: then it is in ``bad``, and never used)
            if size <= POOL_MAX:
                data = common.read_exact(size) if size else b""
                job = functools.partial(_store_object, tmpdir, fan, dest, oid, data, fans, done)
                if writers is None and len(present) <= INLINE_OBJECTS:
                    job()  # a few edited files: starting threads would cost more than it saves
                    continue
                writers = writers or Writers()
                writers.put(job)
            else:
                _store_streamed(tmpdir, fan, dest, oid, size, fans, done)
    except BaseException:
        if writers is not None:
            writers.finish(check=False)
        raise
    if writers is not None:
        writers.finish()
    bad = [oid for oid, size in done if size < 0]
    present.difference_update(bad)
    stored = [size for _oid, size in done if size >= 0]
    return len(stored), sum(stored), bad, present


def skip(size):
    left = size
    while left:
        data = common.stdin().read(min(common.CHUNK, left))
        if not data:
            raise common.Truncated()
        left -= len(data)


def link_or_copy(src, dst, mode):
    try:
        os.link(src, dst)
    except OSError as exc:
        # No hard links here (another file system, a link-count limit, a FS that refuses): copy.
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(src, dst)
        os.chmod(dst, common.private(mode))


def exec_object(root, oid):
    """Executables need their own inode (mode is per inode): ``<oid>.x``, mode 0555, made once."""
    plain = object_path(root, oid)
    path = plain + b".x"
    if not os.path.exists(path):
        tmp = common.temp_name(common.under(root, layout.TMP), oid + ".x")
        common._cleanup.add(tmp)
        try:
            shutil.copyfile(plain, tmp)
            os.chmod(tmp, common.private(0o555))
            os.rename(tmp, path)
        finally:
            common._cleanup.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def place(root, tree, row, made):
    """Put one manifest row into the folder ``tree`` being built (``made``: its folders so far)."""
    _folders(tree, manifest.enc(row[0]), made)
    _put(root, tree, row)


def _folders(tree, pb, made):
    parts = pb.split(b"/")
    for i in range(1, len(parts)):
        d = b"/".join(parts[:i])
        if d not in made:
            os.mkdir(common.join(tree, d), 0o700)
            made.add(d)


def _put_rows(root, tree, rows):
    for row in rows:
        _put(root, tree, row)


def _put(root, tree, row):
    """Link (or copy) one row's object into ``tree``, whose folders exist."""
    mode, oid = row[1], row[2]
    dst = common.join(tree, manifest.enc(row[0]))
    if mode == manifest.MODE_LINK:
        with open(object_path(root, oid), "rb") as fh:
            os.symlink(fh.read(), dst)
    elif mode == manifest.MODE_EXEC:
        link_or_copy(exec_object(root, oid), dst, 0o555)
    else:
        link_or_copy(object_path(root, oid), dst, 0o444)


def _building(root, sid):
    snaps = common.under(root, layout.SNAPSHOTS)
    common.makedirs(snaps)
    build = common.join(
        snaps, b".tmp-" + manifest.enc(sid) + b"-%d-" % os.getpid() + os.urandom(4).hex().encode()
    )
    common._cleanup.add(build)
    os.mkdir(build, 0o700)
    return build


def _finish(root, sid, build, final, meta):
    """Write the meta file, then move the complete folder into place: "created", or "exists"."""
    try:
        common.write_atomic(
            common.under(root, layout.snapshot_meta(sid)),
            json.dumps(meta, ensure_ascii=True).encode("ascii"),
            0o444,
        )
        try:
            os.rename(build, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return "exists"  # someone built the same tree a moment ago: theirs is identical
        return "created"
    finally:
        common._cleanup.discard(build)
        if os.path.lexists(build):
            common.force_rmtree(build)


def _read_only(top, made):
    for d in made:
        os.chmod(common.join(top, d), common.private(0o555))
    os.chmod(top, common.private(0o555))


def build_snapshot(root, sid, text, provenance, files=None, size=None):
    """The full tree of manifest ``text``, its manifest file and meta."""
    rows = manifest.manifest_rows(text)
    build = _building(root, sid)
    try:
        made = set()
        for row in rows:
            _folders(build, manifest.enc(row[0]), made)
        # The links, by Writers threads (as the objects' files: metadata operations in flight
        # together), in runs of rows; the folders all exist already.
        writers = Writers(min(WRITERS, 1 + len(rows) // LINK_RUN))
        try:
            for i in range(0, len(rows), LINK_RUN):
                writers.put(functools.partial(_put_rows, root, build, rows[i : i + LINK_RUN]))
        except BaseException:
            writers.finish(check=False)
            raise
        writers.finish()
        _read_only(build, made)
        common.write_atomic(common.under(root, layout.snapshot_manifest(sid)), text, 0o444)
    except BaseException:
        common._cleanup.discard(build)
        common.force_rmtree(build)
        raise
    meta = {
        "version": 2,
        "id": sid,
        "created": time.time(),
        "files": len(rows) if files is None else files,
        "bytes": sum(r[3] for r in rows) if size is None else size,
        "provenance": provenance() if callable(provenance) else provenance,
    }
    return _finish(root, sid, build, snapshot_dir(root, sid), meta)


class RowFinder:
    """Rows of one manifest by path: a binary search each for a few, one parse of all for many."""

    def __init__(self, text, many):
        self.text = text
        self.rows = dict((r[0], r) for r in manifest.manifest_rows(text)) if many > 64 else None

    def row(self, path):
        if self.rows is not None:
            return self.rows.get(path)
        return manifest.row_at(self.text, path)


def layer_over(base_text, changes, base=None):
    """The rows of ``changes`` that differ from the full snapshot ``base_text``: the layer."""
    base = base or RowFinder(base_text, len(changes))
    layer = {}
    for path, row in changes.items():
        if row != base.row(path):
            layer[path] = row
    return layer


def layer_removals(base_text, text, layer, base=None):
    """What a job deletes from its copy of the base before copying the layer's files in.

    Every path the layer replaces or removes; a folder of the base where the layer puts a file, and a
    file of the base where it needs a folder; and each folder the removals leave empty (the new tree
    has no such folder). Never a path below a symlink of the base, so ``rm -rf`` stays inside.
    """
    base = base or RowFinder(base_text, len(layer))
    out = set()
    for path, row in layer.items():
        parts = path.split("/")
        if base.row(path) is not None:
            out.add(path)
            if row is None:
                gone = None
                for i in range(len(parts) - 1, 0, -1):
                    folder = "/".join(parts[:i])
                    if manifest.has_under(text, folder):
                        break
                    gone = folder
                if gone is not None:
                    out.add(gone)
            continue
        if row is None:
            continue
        if manifest.has_under(base_text, path):
            out.add(path)
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if base.row(above) is not None:
                out.add(above)
                break
    return out


def build_layer(root, sid, resolved, provenance, over):
    """Layer ``sid`` over ``over`` = (base id, base manifest, finder of its rows, {path: row or None}
    differing from it, the new layer's depth)."""
    base_id, base_text, finder, layer, depth = over
    build = _building(root, sid)
    try:
        tree = common.join(build, b"tree")
        os.mkdir(tree, 0o700)
        made = set()
        for path in sorted(layer, key=manifest.enc):
            if layer[path] is not None:
                place(root, tree, layer[path], made)
        _read_only(tree, made)
        gone = layer_removals(base_text, resolved["text"], layer, finder)
        removals = sorted(manifest.enc(p) for p in gone)
        with open(common.join(build, b"remove"), "wb") as fh:
            fh.write(b"".join(p + b"\0" for p in removals))
        with open(common.join(build, b"base"), "wb") as fh:
            fh.write(base_id.encode("ascii") + b"\n")
        for name in (b"remove", b"base"):
            os.chmod(common.join(build, name), common.private(0o444))
        os.chmod(build, common.private(0o555))
        common.write_atomic(common.under(root, layout.snapshot_manifest(sid)), resolved["text"], 0o444)
    except BaseException:
        common._cleanup.discard(build)
        common.force_rmtree(build)
        raise
    meta = {
        "version": 2 if depth == 1 else 3,
        "id": sid,
        "created": time.time(),
        "files": resolved["files"],
        "bytes": resolved["bytes"],
        "base": base_id,
        "depth": depth,
        "layer": {
            "upsert": [layer[p] for p in sorted(layer, key=manifest.enc) if layer[p] is not None],
            "remove": [p for p in sorted(layer, key=manifest.enc) if layer[p] is None],
        },
        "provenance": provenance() if callable(provenance) else provenance,
    }
    return _finish(root, sid, build, common.under(root, layout.snapshot_layer(sid)), meta)


def make_tree(root, sid, resolved, provenance):
    """The cheapest kind that stays bounded: (status, base or None).

    A layer over the snapshot the client named, while the chain stays short and small; else one
    layer over the chain's full snapshot, while that stays small; else a full tree.
    """
    limit = max(LAYER_MIN, resolved["files"] // LAYER_SHARE)
    if resolved["over"] is not None:
        chain, base_text, changes = resolved["over"]
        base_id = chain[0][0]
        finder = RowFinder(base_text, len(changes))  # the base's rows, looked up by both steps
        layer = layer_over(base_text, changes, finder)
        depth = len(chain) - 1
        rows = sum(len(m["layer"]["upsert"]) + len(m["layer"]["remove"]) for _sid, m in chain[:-1])
        if depth < LAYER_DEPTH and rows + len(layer) <= limit:
            over = (base_id, base_text, finder, layer, depth + 1)
            return build_layer(root, sid, resolved, provenance, over), base_id
        if depth > 0:
            full_id = chain[-1][0]
            merged = chain_changes(chain)
            merged.update(changes)
            full_text = read_manifest(root, full_id)
            finder = RowFinder(full_text, len(merged))
            layer = layer_over(full_text, merged, finder)
            if len(layer) <= limit:
                over = (full_id, full_text, finder, layer, 1)
                return build_layer(root, sid, resolved, provenance, over), full_id
    return build_snapshot(root, sid, resolved["text"], provenance, resolved["files"], resolved["bytes"]), None


def layer_base(root, sid):
    """The full snapshot a stored snapshot sits on (None when it is a full tree itself)."""
    if os.path.isdir(snapshot_dir(root, sid)):
        return None
    try:
        return read_meta(root, sid).get("base")
    except (OSError, ValueError):
        return None


def mode_snap_put(args):
    """Receive objects, then make the snapshot when everything it needs is here.

    A header without ``build`` asks only: nothing is built, the reply lists what is missing (maybe
    nothing), and the client calls again. With ``build``, a frame holding the provenance follows the
    objects' ``E`` (the client's ``git diff`` runs while the objects travel).
    """
    root = common.root_path(args["root"])
    payload = common.read_header()
    sid = payload["id"]
    clean_stale_temps(root)
    build = bool(payload.get("build")) or "provenance" in payload
    trailer = []

    def provenance():
        """The provenance frame after the objects (read once, when first needed): the client makes
        it (git diff) while the objects travel, and the tree is built while it is made; only the
        meta file, written last, holds it."""
        if not trailer:
            trailer.append(
                common.read_header()["provenance"] if payload.get("build") else payload.get("provenance")
            )
        return trailer[0]

    with locks.store_lock(root, exclusive=False):
        received, received_bytes, bad, present = receive_objects(root)
        result = {"received": received, "received_bytes": received_bytes, "bad": bad}
        if snapshot_exists(root, sid):
            provenance()  # read before replying, as every reply but "created" does: stdin stays whole
            touch(common.under(root, layout.snapshot_meta(sid)))  # "last used": gc measures age from here
            result.update(status="exists", base=layer_base(root, sid))
            return result
        resolved = resolve_manifest(root, sid, payload)
        if resolved is None:
            provenance()
            result["status"] = "need-full"
            return result
        missing = missing_objects(root, resolved["new"], present)
        if missing or not build:
            provenance()
            result.update(status="missing", missing=sorted(missing))
            return result
        status, base = make_tree(root, sid, resolved, provenance)
        result.update(status=status, base=base if status == "created" else layer_base(root, sid))
        return result


_SNAP_NAME = re.compile(rb"^([0-9a-f]{24})(\.layer|\.json|\.manifest)?$")


def _snapshot_objects(root, sid, meta):
    """The object ids a snapshot's own files use (a layer's, not its base's)."""
    if meta.get("version") != 2:
        return set(e[2] for e in meta["entries"])
    if meta.get("base") is not None:
        return set(r[2] for r in meta["layer"]["upsert"])
    return set(r[2] for r in manifest.manifest_rows(read_manifest(root, sid)))


def collect_garbage(root, in_use, args, freed, dry):
    """Snapshots no kept run uses and unused for ``older_than``, then objects no kept snapshot needs.

    A kept layer keeps the snapshot it sits on, and that one its own, down to a full snapshot.
    """
    older_than = float(args["older_than"])
    grace = float(args.get("grace", 900))
    report = {"removed": [], "kept": [], "objects_removed": 0}
    warnings = []
    snaps = common.under(root, layout.SNAPSHOTS)
    with locks.store_lock(root, exclusive=True, wait=float(args.get("lock_wait", 120))):
        now = time.time()
        names = os.listdir(snaps) if os.path.isdir(snaps) else []
        parts = {}  # id -> the suffixes present (b"" for a full tree)
        for name in sorted(names):
            path = common.join(snaps, name)
            if name.startswith(b".tmp-"):
                if now - os.lstat(path).st_mtime > STALE_BUILD_S:
                    common.remove_counted(path, freed, dry)
                continue
            m = _SNAP_NAME.match(name)
            if m:
                parts.setdefault(manifest.dec(m.group(1)), set()).add(m.group(2) or b"")
        metas = {}
        kept, doomed = {}, []
        for sid in sorted(parts):
            have = parts[sid]
            if b"" not in have and b".layer" not in have:
                continue  # a meta or manifest left without its tree: see below
            path = snapshot_dir(root, sid)
            meta_path = common.under(root, layout.snapshot_meta(sid))
            folder = path if b"" in have else common.under(root, layout.snapshot_layer(sid))
            used = os.lstat(meta_path).st_mtime if b".json" in have else os.lstat(folder).st_mtime
            age = now - used
            if sid in in_use:
                kept[sid] = (age, "used by a run that is kept")
            elif age < max(older_than, grace):
                kept[sid] = (age, "used %s ago" % common.human_age(age))
            else:
                doomed.append((sid, age))
        unreadable = []
        todo = list(kept)  # a kept layer keeps its base, and so on down the chain
        while todo:
            sid = todo.pop()
            try:
                metas[sid] = read_meta(root, sid)
            except (OSError, ValueError):
                unreadable.append(sid)
                continue
            base = metas[sid].get("base")
            if base is not None and base not in kept and base in parts:
                ages = dict(doomed)
                kept[base] = (ages.get(base, 0), "the base of kept layer %s" % sid)
                doomed = [d for d in doomed if d[0] != base]
                todo.append(base)
        for sid, age in doomed:
            row = {"id": sid, "age_s": round(age)}
            before = freed.bytes
            path = snapshot_dir(root, sid)
            for suffix in (b"", b".layer", b".json", b".manifest"):
                if suffix in parts[sid]:
                    common.remove_counted(path + suffix, freed, dry)
            row["bytes"] = freed.bytes - before
            report["removed"].append(row)
        for sid in sorted(kept):
            report["kept"].append({"id": sid, "age_s": round(kept[sid][0]), "reason": kept[sid][1]})
        # Meta and manifest files left without their tree (a build that died between the renames).
        for sid, have in parts.items():
            if b"" in have or b".layer" in have:
                continue
            for suffix in (b".json", b".manifest"):
                p = snapshot_dir(root, sid) + suffix
                if suffix in have and now - os.lstat(p).st_mtime > grace:
                    common.remove_counted(p, freed, dry)
        referenced = set()
        for sid in unreadable:
            referenced = None
            warnings.append("snapshot %s has no readable manifest, so no object was removed" % sid)
            break
        for sid in sorted(kept) if referenced is not None else []:
            try:
                referenced.update(_snapshot_objects(root, sid, metas[sid]))
            except (OSError, ValueError, KeyError):
                referenced = None
                warnings.append("snapshot %s has no readable manifest, so no object was removed" % sid)
                break
        if referenced is not None:
            # In a dry run the removed snapshots still exist: their links are counted as removed by
            # _remove above, so the objects they share are counted as freed here, as they would be.
            objects = common.under(root, layout.OBJECTS)
            for fan in sorted(os.listdir(objects)) if os.path.isdir(objects) else []:
                fan_path = common.join(objects, fan)
                if fan.startswith(b".") or not os.path.isdir(fan_path):
                    continue
                for name in os.listdir(fan_path):
                    if manifest.dec(name)[:40] in referenced:
                        continue
                    report["objects_removed"] += 1
                    common.remove_counted(common.join(fan_path, name), freed, dry)
        if not dry:
            clean_stale_temps(root)
    report["warnings"] = warnings
    return report
