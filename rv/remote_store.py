"""The cluster-side half of snapshots and sync: a small stdlib-only program rv ships on every call.

rv never installs anything on the cluster. Each remote step runs this file's source, compressed, as
``python3 -c ... MODE ARGS`` over the one SSH connection (see :func:`rv.agent_client.agent_command`);
bulk data travels on the same command's stdin or stdout, so a step is one round trip however many
files it moves.

Modes (ARGS is one JSON object; every reply is zlib-compressed JSON on stdout):

``snap-query``  does ``snapshots/<id>`` exist? If not, which of its objects are missing?
                (the id and manifest come on stdin, so the command can start before they are known)
``snap-put``    receive objects, then build ``snapshots/<id>`` from hard links into ``objects/``
``gc``          remove snapshots no live job uses and objects no snapshot references
``scan``        list a file or folder (size, mtime, mode; blob ids where asked) for push and pull
``apply``       carry out a push plan: deletions, uploads, chmods, symlinks
``send``        stream files back for pull

Rules every mode keeps:

* An object's name is the git blob id of its content, checked on arrival; it is written under
  ``tmp/`` and renamed into ``objects/`` only when complete and correct, so an interrupted upload
  never leaves a bad object (and the partial temp file is removed when stdin ends early).
* ``snapshots/<id>`` appears by one rename of a fully built tree, so it exists only when complete.
* gc takes the store lock exclusively; uploads and queries hold it shared.
* Private by default: every mode runs under the umask the client sends (077, or 027 when the
  profile shares with the group), explicit modes are masked by it too (objects 0400, executables
  0500, snapshot folders 0500), and the remote root itself is kept at 0700 (0750), so nothing under
  it is reachable by others even in a store written by an older rv.
* Paths travel as UTF-8 with surrogate escapes and are used as bytes here, so file names that are
  not valid UTF-8, and a cluster whose locale is C, both work.

It must run on the oldest python3 a cluster login node has (RHEL 8: 3.6), so: no dataclasses, no
walrus, no ``capture_output``, no postponed annotations.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import struct
import sys
import time
import zlib

VERSION = 1
CHUNK = 1 << 20
MODE_FILE = 0o100644
MODE_EXEC = 0o100755
MODE_LINK = 0o120000
TMP_STALE_S = 3600  # temp files untouched this long belong to a dead upload
STALE_BUILD_S = 86400


class AgentError(Exception):
    """A failure the client maps to an rv error: ``code`` names the kind."""

    def __init__(self, message, code="remote"):
        Exception.__init__(self, message)
        self.code = code


class Truncated(Exception):
    """stdin ended in the middle of a frame: the client went away."""


# -- shared with the client (rv.snapshot imports these, so both sides agree byte for byte) ----------


def enc(path):
    return path.encode("utf-8", "surrogateescape")


def dec(path):
    return path.decode("utf-8", "surrogateescape")


def blob_hasher(size):
    """git's blob id: sha1 over ``blob <size>\\0`` and the content."""
    h = hashlib.sha1()
    h.update(b"blob " + str(size).encode("ascii") + b"\0")
    return h


def sort_entries(entries):
    return sorted(entries, key=lambda e: enc(e[0]))


# A manifest is text: one line per file, ``["path",mode,"oid",size]`` in JSON (ASCII only, so no
# line can hold a raw newline), sorted by the path's bytes; the snapshot id is a hash of that text.
# A line is found by binary search and replaced in place, so a manifest made from a known one by a
# few changes costs Python work in proportion to the changes (on both sides), plus one pass of C
# over the bytes (a copy and a hash): a resubmit of a 50,000-file repo never parses 50,000 lines.
MANIFEST_TAG = b"rv-snapshot-2\n"
_LINE = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


def manifest_line(row):
    return _LINE.encode([row[0], row[1], row[2], row[3]]).encode("ascii") + b"\n"


def manifest_text(rows):
    """The manifest of rows ``[path, mode, oid, size]`` given in any order."""
    return b"".join(manifest_line(r) for r in sort_entries(rows))


def text_id(text):
    h = hashlib.sha256(MANIFEST_TAG)
    h.update(text)
    return h.hexdigest()[:24]


def manifest_id(entries):
    """The snapshot id of rows ``[path, mode, oid, size]`` (any order)."""
    return text_id(manifest_text(entries))


def parse_line(line):
    return json.loads(line.decode("ascii"))


def manifest_rows(text):
    """Every row of a manifest (one C-speed parse)."""
    if not text:
        return []
    return json.loads((b"[" + text[:-1].replace(b"\n", b",") + b"]").decode("ascii"))


def find_line(text, key, lo=0):
    """``(start, end, found)``: the line whose path's bytes are ``key``, or where it would go.

    ``lo`` is a line start the search begins at (the lines before it sort before ``key``).
    """
    hi = len(text)
    while lo < hi:
        mid = (lo + hi) // 2
        start = text.rfind(b"\n", lo, mid) + 1
        if start < lo:
            start = lo
        end = text.index(b"\n", start) + 1
        k = enc(parse_line(text[start:end])[0])
        if k < key:
            lo = end
        elif k > key:
            hi = start
        else:
            return start, end, True
    return lo, lo, False


def row_at(text, path):
    """The row of ``path`` in a manifest, or None."""
    start, end, found = find_line(text, enc(path))
    return parse_line(text[start:end]) if found else None


def has_under(text, folder):
    """Does the manifest hold anything inside ``folder`` (a path without the trailing slash)?"""
    prefix = enc(folder) + b"/"
    start, _end, _found = find_line(text, prefix)
    if start >= len(text):
        return False
    end = text.index(b"\n", start) + 1
    return enc(parse_line(text[start:end])[0]).startswith(prefix)


def splice(text, changes):
    """``(new text, old rows)``: ``changes`` ({path: row, or None to remove}) applied to a manifest.

    ``old rows`` maps each changed path to the row it replaced (None where there was none).
    """
    if len(changes) > 64 and len(changes) * 12 > text.count(b"\n"):
        # Many changes: one parse of everything is cheaper than a search per change.
        by_path = dict((r[0], r) for r in manifest_rows(text))
        old = dict((p, by_path.get(p)) for p in changes)
        for path, row in changes.items():
            if row is None:
                by_path.pop(path, None)
            else:
                by_path[path] = row
        return manifest_text(list(by_path.values())), old
    out, old, pos = [], {}, 0
    for key, path in sorted((enc(p), p) for p in changes):
        start, end, found = find_line(text, key, pos)
        old[path] = parse_line(text[start:end]) if found else None
        out.append(text[pos:start])
        row = changes[path]
        if row is not None:
            out.append(manifest_line(row))
        pos = end if found else start
    out.append(text[pos:])
    return b"".join(out), old


def same_mtime(a, b):
    """Equal mtimes, allowing for a file system that keeps whole seconds only (Lustre, some NFS)."""
    if a == b:
        return True
    return a // 1000000000 == b // 1000000000 and (a % 1000000000 == 0 or b % 1000000000 == 0)


def check_relpath(path):
    """A manifest path: relative, no ``..``, no empty part, never inside ``.git``."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..", ".git") for p in parts):
        raise AgentError("refusing unsafe path %r" % path, "usage")
    return path


# -- plumbing ------------------------------------------------------------------------------------------

_stdin = None
_cleanup = set()
UMASK = 0o077  # replaced by the client's (see main); private unless the profile shares with the group


def private(mode):
    """``mode`` without what the umask forbids: what a chmod must use (chmod ignores the umask)."""
    return mode & ~UMASK & 0o7777


def protect_root(root):
    """Keep the remote root itself at 0700 (0750): the one gate in front of everything below it."""
    want = 0o777 & ~UMASK
    with contextlib.suppress(OSError):  # not there yet (makedirs creates it with the umask)
        st = os.stat(root)
        if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) != want and st.st_uid == os.getuid():
            os.chmod(root, want)


def stdin():
    global _stdin
    if _stdin is None:
        _stdin = sys.stdin.buffer
    return _stdin


def read_exact(n):
    data = stdin().read(n)
    if data is None or len(data) != n:
        raise Truncated()
    return data


def read_header():
    (n,) = struct.unpack(">I", read_exact(4))
    return json.loads(zlib.decompress(read_exact(n)).decode("ascii"))


def reply(obj):
    out = sys.stdout.buffer
    out.write(zlib.compress(json.dumps(obj, ensure_ascii=True).encode("ascii")))
    out.flush()


def root_path(root):
    return enc(os.path.expanduser(root))


def resolve(root, path):
    """Relative paths are under the remote root; ``~/...`` is the remote home; absolute is as is."""
    if path.startswith("~"):
        return enc(os.path.expanduser(path))
    if path.startswith("/"):
        return enc(path)
    return os.path.join(root_path(root), enc(path))


def join(*parts):
    return os.path.join(*parts)


def object_path(root, oid):
    return join(root, b"objects", enc(oid[:2]), enc(oid))


def makedirs(path, mode=0o755):
    try:
        os.makedirs(path, mode)
    except OSError as exc:
        if exc.errno != errno.EEXIST or not os.path.isdir(path):
            raise


def temp_name(directory, tag):
    return join(directory, b".rv-tmp-" + enc(tag) + b"-%d-" % os.getpid() + os.urandom(6).hex().encode())


def force_rmtree(path):
    """Remove a tree made read-only on purpose (snapshots): restore write bits, then delete."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
        return
    for dirpath, dirnames, _files in os.walk(path):
        os.chmod(dirpath, 0o700)
        for d in dirnames:
            p = join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    shutil.rmtree(path)


# -- locks -----------------------------------------------------------------------------------------
# flock where the filesystem has it: the kernel drops it when its holder dies. Some Lustre and NFS
# mounts answer flock with ENOLCK, EOPNOTSUPP or ENOSYS; there an atomic mkdir takes its place, with a
# note of who holds it, taken over once the holder is gone (same host, dead pid) or the note is older
# than ``stale`` seconds. Either way a busy lock names its holder.
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
LOCK_STALE_S = 3600.0


def _holder_note(what):
    import socket

    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "what": what})


def _busy(path, raw_note):
    """The error for a lock held too long, naming its holder from the note it left."""
    holder = "another rv"
    try:
        note = json.loads(raw_note.decode("utf-8", "replace"))
        since = time.strftime("%H:%M:%S", time.localtime(note["since"]))
        what = note.get("what") or holder
        holder = "%s (pid %s on %s, since %s)" % (what, note["pid"], note["host"], since)
    except (ValueError, KeyError, TypeError):
        pass  # no note, or a half-written one: the generic holder
    return AgentError("%s is busy: held by %s; try again when it is done" % (dec(path), holder), "busy")


def _holder_gone(note_path, stale):
    import socket

    try:
        with open(note_path, "rb") as fh:
            note = json.loads(fh.read().decode("utf-8", "replace"))
    except (OSError, ValueError):
        # No note yet: its maker is between mkdir and writing it, or died there. Judge by age.
        try:
            return time.time() - os.lstat(os.path.dirname(note_path)).st_mtime > stale
        except OSError:
            return True
    if time.time() - float(note.get("since", 0)) > stale:
        return True
    if note.get("host") == socket.gethostname():
        try:
            os.kill(int(note["pid"]), 0)
        except ProcessLookupError:
            return True
        except (OSError, ValueError, KeyError):
            return False
    return False


@contextlib.contextmanager
def _mkdir_lock(path, what, wait, stale):
    lock_dir = path + b".d"
    note = join(lock_dir, b"holder")
    deadline = time.time() + wait
    while True:
        try:
            os.mkdir(lock_dir, 0o700)
            break
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                raise
        if _holder_gone(note, stale):
            # Rename first: of two rv that both found it stale, only one takes it over.
            aside = lock_dir + b".stale-" + os.urandom(4).hex().encode()
            with contextlib.suppress(OSError):
                os.rename(lock_dir, aside)
                shutil.rmtree(aside, ignore_errors=True)
            continue
        if time.time() > deadline:
            raw_note = b""
            with contextlib.suppress(OSError), open(note, "rb") as fh:
                raw_note = fh.read()
            raise _busy(path, raw_note)
        time.sleep(0.2)
    try:
        with open(note, "w") as fh:
            fh.write(_holder_note(what))
        yield "mkdir"
    finally:
        shutil.rmtree(lock_dir, ignore_errors=True)


@contextlib.contextmanager
def lock(path, what, exclusive=True, wait=120.0, stale=LOCK_STALE_S):
    """Hold the lock ``path`` (bytes) for ``what`` (named to whoever finds it busy).

    Yields "flock" or "mkdir": which kind was taken. Without flock every holder is exclusive.
    """
    makedirs(os.path.dirname(path), 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.time() + wait
        flag = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        while True:
            try:
                fcntl.flock(fd, flag | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in NO_FLOCK:
                    with _mkdir_lock(path, what, wait, stale) as kind:
                        yield kind
                    return
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.time() > deadline:
                    raise _busy(path, os.pread(fd, 4096, 0)) from None
                time.sleep(0.2)
        if exclusive:
            # Shared holders leave the note alone: it names the last exclusive one, for messages.
            os.ftruncate(fd, 0)
            os.pwrite(fd, _holder_note(what).encode(), 0)
        yield "flock"
    finally:
        os.close(fd)


def store_lock(root, exclusive, wait=120.0):
    """The store's lock (objects/.lock): gc exclusive, uploads and queries shared."""
    what = "rv gc" if exclusive else "an rv upload"
    return lock(join(root, b"objects", b".lock"), what, exclusive=exclusive, wait=wait)


def write_atomic(path, data, mode):
    directory = os.path.dirname(path)
    tmp = temp_name(directory, "meta")
    _cleanup.add(tmp)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, private(mode))
        os.replace(tmp, path)
    finally:
        _cleanup.discard(tmp)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def receive_into(tmp, size, hasher, mode=0o600):
    """Copy ``size`` bytes of stdin into a new file ``tmp`` (created with ``mode``), feeding ``hasher``."""
    left = size
    # Created with its final mode: the descriptor stays writable, and no chmod is needed after.
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, private(mode)), "wb") as fh:
        while left:
            data = stdin().read(min(CHUNK, left))
            if not data:
                raise Truncated()
            hasher.update(data)
            fh.write(data)
            left -= len(data)


def clean_stale_temps(root):
    tmpdir = join(root, b"tmp")
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(tmpdir):
            if name.startswith(b".rv-tmp-"):
                p = join(tmpdir, name)
                with contextlib.suppress(OSError):
                    if now - os.lstat(p).st_mtime > TMP_STALE_S:
                        os.unlink(p)


# -- snapshots -----------------------------------------------------------------------------------------
# A snapshot is ``snapshots/<id>.json`` (provenance, counts) and either
#
# * a full tree ``snapshots/<id>/`` of hard links into objects/, with its manifest in
#   ``snapshots/<id>.manifest``; or
# * a layer ``snapshots/<id>.layer/`` over another snapshot (its ``base``, the one the client named:
#   usually the previous submit's): ``tree/`` holds hard links of only the files that differ from
#   the base, ``remove`` (NUL-separated) the paths a job deletes from its copy of the base before it
#   copies the layer's files in, ``base`` the base's id. The meta file holds the layer's rows
#   (``upsert``, ``remove``) and its ``depth`` (1 over a full snapshot); the manifest is the base's
#   with the rows, kept whole in ``snapshots/<id>.manifest`` so the next layer starts from a read,
#   not a splice (~0.25 s for 2,500 rows over 50,000 files). Layers of an earlier rv have no such
#   file (they sit on a full snapshot and are spliced from its manifest).
#
# A layer costs work in proportion to what changed since its base, so a resubmit after an edit is
# cheap however big the repo is and however much else is uncommitted: a job copies the full
# snapshot at the bottom and applies the layers up the chain in order. A chain stops at LAYER_DEPTH
# layers or at LAYER_MIN / LAYER_SHARE of the files in all; then the next snapshot is one layer
# holding everything that differs from the full snapshot (once), or, past that share too, a full
# tree, which later layers then sit on. Layers deeper than one have meta version 3, so an older rv
# takes them for no base at all (it sends the full list) instead of misreading them. Every kind
# appears by one rename of a folder built complete beside them. Snapshots of rv 0.1 (entries in
# the meta file, a full tree, version 1) are still collected by gc and used by the jobs that name
# them.

LAYER_MIN = 256
LAYER_SHARE = 16
LAYER_DEPTH = 8
CHAIN_BROKEN = 4 * LAYER_DEPTH  # more links than this: a loop or a damaged store (jobs check it too)


def snapshot_dir(root, sid):
    if not re.match(r"^[0-9a-f]{24}$", sid):
        raise AgentError("bad snapshot id %r" % sid, "usage")
    return join(root, b"snapshots", enc(sid))


def snapshot_exists(root, sid):
    path = snapshot_dir(root, sid)
    return os.path.isdir(path) or os.path.isdir(path + b".layer")


def read_meta(root, sid):
    with open(snapshot_dir(root, sid) + b".json", "rb") as fh:
        return json.loads(fh.read().decode("ascii"))


def read_manifest(root, sid):
    with open(snapshot_dir(root, sid) + b".manifest", "rb") as fh:
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
        text = splice(read_manifest(root, meta["base"]), layer_changes(meta["layer"]))[0]
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
            raise AgentError("bad manifest entry %r" % (e,), "usage")
        check_relpath(e[0])
        if e[1] not in (MODE_FILE, MODE_EXEC, MODE_LINK) or not re.match(r"^[0-9a-f]{40}$", e[2]):
            raise AgentError("bad manifest entry %r" % (e,), "usage")
        if not isinstance(e[3], int) or e[3] < 0:
            raise AgentError("bad manifest entry %r" % (e,), "usage")


def resolve_manifest(root, sid, payload):
    """The manifest the client means: a full list, or changes to a snapshot stored here.

    Returns None when that snapshot is gone or not what the client thought (it then sends the full
    list), else a dict: ``text``, ``files``, ``bytes``, ``new`` (the rows that may need objects:
    with changes to a stored snapshot, only the upserted ones; that snapshot's objects are referenced
    by it, and gc cannot remove them while the caller holds the store lock) and ``over``: None, or
    ``(its chain, its manifest, {path: row or None})``: the changes to it (see :func:`layer_chain`).
    """
    if "entries" in payload:
        rows = payload["entries"]
        check_rows(rows)
        text = manifest_text(rows)
        if text_id(text) != sid:
            raise AgentError("the manifest sent does not hash to snapshot id %s" % sid, "remote")
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
        changes[check_relpath(path)] = None
    for row in upsert:
        changes[row[0]] = row
    text, old = splice(base_text, changes)
    if text_id(text) != sid:
        return None  # the client's copy of the base differs from the one here: ask for all
    files = int(meta["files"]) + sum((changes[p] is not None) - (old[p] is not None) for p in changes)
    size = int(meta["bytes"]) + sum(r[3] for r in upsert) - sum(r[3] for r in old.values() if r is not None)
    return {"text": text, "files": files, "bytes": size, "new": upsert, "over": (chain, base_text, changes)}


def missing_objects(root, entries):
    missing = {}
    for _path, _mode, oid, size in entries:
        if oid not in missing and not os.path.exists(object_path(root, oid)):
            missing[oid] = size
    return missing


def touch(path):
    with contextlib.suppress(OSError):
        os.utime(path, None)


def mode_snap_query(args):
    # The id comes on stdin, not in ARGS: the client starts this command (shell and python start-up)
    # while it is still listing and hashing, and writes the header once it knows the id.
    root = root_path(args["root"])
    payload = read_header()
    sid = payload["id"]
    with store_lock(root, exclusive=False):
        if snapshot_exists(root, sid):
            touch(snapshot_dir(root, sid) + b".json")  # "last used": gc measures age from here
            return {"status": "exists"}
        resolved = resolve_manifest(root, sid, payload)
        if resolved is None:
            return {"status": "need-full"}
        missing = missing_objects(root, resolved["new"])
        return {"status": "missing", "missing": sorted(missing), "bytes": sum(missing.values())}


def receive_objects(root):
    """Read ``O <oid:20> <size:8> <content>`` frames until ``E``; each lands by rename when correct.

    An object already stored is read past, not written again (the client may send a few small ones
    without asking first).
    """
    tmpdir = join(root, b"tmp")
    makedirs(tmpdir)
    fans = set()  # objects/xx folders known to exist: a failing mkdir per object adds up
    received, received_bytes, bad = 0, 0, []
    while True:
        tag = read_exact(1)
        if tag == b"E":
            return received, received_bytes, bad
        if tag != b"O":
            raise AgentError("corrupt upload stream (tag %r)" % tag)
        oid = read_exact(20).hex()
        (size,) = struct.unpack(">Q", read_exact(8))
        dest = object_path(root, oid)
        if os.path.exists(dest):
            skip(size)
            continue
        tmp = temp_name(tmpdir, oid)
        _cleanup.add(tmp)
        try:
            hasher = blob_hasher(size)
            receive_into(tmp, size, hasher, 0o444)
            if hasher.hexdigest() == oid:
                if oid[:2] not in fans:
                    makedirs(os.path.dirname(dest))
                    fans.add(oid[:2])
                os.rename(tmp, dest)
                received += 1
                received_bytes += size
            else:
                bad.append(oid)  # the local file changed while it was read: never store it
        finally:
            _cleanup.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def skip(size):
    left = size
    while left:
        data = stdin().read(min(CHUNK, left))
        if not data:
            raise Truncated()
        left -= len(data)


def link_or_copy(src, dst, mode):
    try:
        os.link(src, dst)
    except OSError as exc:
        # No hard links here (another file system, a link-count limit, a FS that refuses): copy.
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
        shutil.copyfile(src, dst)
        os.chmod(dst, private(mode))


def exec_object(root, oid):
    """Executables need their own inode (mode is per inode): ``<oid>.x``, mode 0555, made once."""
    plain = object_path(root, oid)
    path = plain + b".x"
    if not os.path.exists(path):
        tmp = temp_name(join(root, b"tmp"), oid + ".x")
        _cleanup.add(tmp)
        try:
            shutil.copyfile(plain, tmp)
            os.chmod(tmp, private(0o555))
            os.rename(tmp, path)
        finally:
            _cleanup.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return path


def place(root, tree, row, made):
    """Put one manifest row into the folder ``tree`` being built (``made``: its folders so far)."""
    path, mode, oid = row[0], row[1], row[2]
    pb = enc(path)
    parts = pb.split(b"/")
    for i in range(1, len(parts)):
        d = b"/".join(parts[:i])
        if d not in made:
            os.mkdir(join(tree, d), 0o700)
            made.add(d)
    dst = join(tree, pb)
    if mode == MODE_LINK:
        with open(object_path(root, oid), "rb") as fh:
            os.symlink(fh.read(), dst)
    elif mode == MODE_EXEC:
        link_or_copy(exec_object(root, oid), dst, 0o555)
    else:
        link_or_copy(object_path(root, oid), dst, 0o444)


def _building(root, sid):
    snaps = join(root, b"snapshots")
    makedirs(snaps)
    build = join(snaps, b".tmp-" + enc(sid) + b"-%d-" % os.getpid() + os.urandom(4).hex().encode())
    _cleanup.add(build)
    os.mkdir(build, 0o700)
    return build


def _finish(root, sid, build, final, meta):
    """Write the meta file, then move the complete folder into place: "created", or "exists"."""
    try:
        write_atomic(
            snapshot_dir(root, sid) + b".json", json.dumps(meta, ensure_ascii=True).encode("ascii"), 0o444
        )
        try:
            os.rename(build, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            return "exists"  # someone built the same tree a moment ago: theirs is identical
        return "created"
    finally:
        _cleanup.discard(build)
        if os.path.lexists(build):
            force_rmtree(build)


def _read_only(top, made):
    for d in made:
        os.chmod(join(top, d), private(0o555))
    os.chmod(top, private(0o555))


def build_snapshot(root, sid, text, provenance, files=None, size=None):
    """The full tree of manifest ``text``, its manifest file and meta."""
    rows = manifest_rows(text)
    build = _building(root, sid)
    try:
        made = set()
        for row in rows:
            place(root, build, row, made)
        _read_only(build, made)
        write_atomic(snapshot_dir(root, sid) + b".manifest", text, 0o444)
    except BaseException:
        _cleanup.discard(build)
        force_rmtree(build)
        raise
    meta = {
        "version": 2,
        "id": sid,
        "created": time.time(),
        "files": len(rows) if files is None else files,
        "bytes": sum(r[3] for r in rows) if size is None else size,
        "provenance": provenance,
    }
    return _finish(root, sid, build, snapshot_dir(root, sid), meta)


class RowFinder(object):
    """Rows of one manifest by path: a binary search each for a few, one parse of all for many."""

    def __init__(self, text, many):
        self.text = text
        self.rows = dict((r[0], r) for r in manifest_rows(text)) if many > 64 else None

    def row(self, path):
        if self.rows is not None:
            return self.rows.get(path)
        return row_at(self.text, path)


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
                    if has_under(text, folder):
                        break
                    gone = folder
                if gone is not None:
                    out.add(gone)
            continue
        if row is None:
            continue
        if has_under(base_text, path):
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
        tree = join(build, b"tree")
        os.mkdir(tree, 0o700)
        made = set()
        for path in sorted(layer, key=enc):
            if layer[path] is not None:
                place(root, tree, layer[path], made)
        _read_only(tree, made)
        gone = layer_removals(base_text, resolved["text"], layer, finder)
        removals = sorted(enc(p) for p in gone)
        with open(join(build, b"remove"), "wb") as fh:
            fh.write(b"".join(p + b"\0" for p in removals))
        with open(join(build, b"base"), "wb") as fh:
            fh.write(base_id.encode("ascii") + b"\n")
        for name in (b"remove", b"base"):
            os.chmod(join(build, name), private(0o444))
        os.chmod(build, private(0o555))
        write_atomic(snapshot_dir(root, sid) + b".manifest", resolved["text"], 0o444)
    except BaseException:
        _cleanup.discard(build)
        force_rmtree(build)
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
            "upsert": [layer[p] for p in sorted(layer, key=enc) if layer[p] is not None],
            "remove": [p for p in sorted(layer, key=enc) if layer[p] is None],
        },
        "provenance": provenance,
    }
    return _finish(root, sid, build, snapshot_dir(root, sid) + b".layer", meta)


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

    A header without provenance asks only: nothing is built, the reply lists what is missing (maybe
    nothing), and the client calls again with the provenance.
    """
    root = root_path(args["root"])
    payload = read_header()
    sid = payload["id"]
    clean_stale_temps(root)
    with store_lock(root, exclusive=False):
        received, received_bytes, bad = receive_objects(root)
        result = {"received": received, "received_bytes": received_bytes, "bad": bad}
        if snapshot_exists(root, sid):
            touch(snapshot_dir(root, sid) + b".json")  # "last used": gc measures age from here
            result.update(status="exists", base=layer_base(root, sid))
            return result
        resolved = resolve_manifest(root, sid, payload)
        if resolved is None:
            result["status"] = "need-full"
            return result
        missing = missing_objects(root, resolved["new"])
        if missing or "provenance" not in payload:
            result.update(status="missing", missing=sorted(missing))
            return result
        status, base = make_tree(root, sid, resolved, payload["provenance"])
        result.update(status=status, base=base if status == "created" else layer_base(root, sid))
        return result


# -- garbage collection ----------------------------------------------------------------------------
# The runs side (rv.job.remote, mode "gc") decides which runs stay and calls this with the snapshots
# they use; ``freed`` counts, inode by inode, what each removal frees.

_SNAP_NAME = re.compile(rb"^([0-9a-f]{24})(\.layer|\.json|\.manifest)?$")


def _snapshot_objects(root, sid, meta):
    """The object ids a snapshot's own files use (a layer's, not its base's)."""
    if meta.get("version") != 2:
        return set(e[2] for e in meta["entries"])
    if meta.get("base") is not None:
        return set(r[2] for r in meta["layer"]["upsert"])
    return set(r[2] for r in manifest_rows(read_manifest(root, sid)))


def collect_garbage(root, in_use, args, freed, dry):
    """Snapshots no kept run uses and unused for ``older_than``, then objects no kept snapshot needs.

    A kept layer keeps the snapshot it sits on, and that one its own, down to a full snapshot.
    """
    older_than = float(args["older_than"])
    grace = float(args.get("grace", 900))
    report = {"removed": [], "kept": [], "objects_removed": 0}
    warnings = []
    snaps = join(root, b"snapshots")
    with store_lock(root, exclusive=True, wait=float(args.get("lock_wait", 120))):
        now = time.time()
        names = os.listdir(snaps) if os.path.isdir(snaps) else []
        parts = {}  # id -> the suffixes present (b"" for a full tree)
        for name in sorted(names):
            path = join(snaps, name)
            if name.startswith(b".tmp-"):
                if now - os.lstat(path).st_mtime > STALE_BUILD_S:
                    remove_counted(path, freed, dry)
                continue
            m = _SNAP_NAME.match(name)
            if m:
                parts.setdefault(dec(m.group(1)), set()).add(m.group(2) or b"")
        metas = {}
        kept, doomed = {}, []
        for sid in sorted(parts):
            have = parts[sid]
            if b"" not in have and b".layer" not in have:
                continue  # a meta or manifest left without its tree: see below
            path = snapshot_dir(root, sid)
            meta_path = path + b".json"
            folder = path if b"" in have else path + b".layer"
            used = os.lstat(meta_path).st_mtime if b".json" in have else os.lstat(folder).st_mtime
            age = now - used
            if sid in in_use:
                kept[sid] = (age, "used by a run that is kept")
            elif age < max(older_than, grace):
                kept[sid] = (age, "used %s ago" % human_age(age))
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
                    remove_counted(path + suffix, freed, dry)
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
                    remove_counted(p, freed, dry)
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
            objects = join(root, b"objects")
            for fan in sorted(os.listdir(objects)) if os.path.isdir(objects) else []:
                fan_path = join(objects, fan)
                if fan.startswith(b".") or not os.path.isdir(fan_path):
                    continue
                for name in os.listdir(fan_path):
                    if dec(name)[:40] in referenced:
                        continue
                    report["objects_removed"] += 1
                    remove_counted(join(fan_path, name), freed, dry)
        if not dry:
            clean_stale_temps(root)
    report["warnings"] = warnings
    return report


def remove_counted(path, freed, dry):
    freed.note(path)
    if dry:
        return
    if os.path.isdir(path) and not os.path.islink(path):
        force_rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def human_age(seconds):
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return "%d%s" % (seconds // size, unit)
    return "%ds" % seconds


# -- scan / apply / send (push and pull) -----------------------------------------------------------


def file_oid(path, size):
    h = blob_hasher(size)
    with open(path, "rb") as fh:
        for data in iter(lambda: fh.read(CHUNK), b""):
            h.update(data)
    return h.hexdigest()


def mode_scan(args):
    """List ``path``: ``[rel, kind, mode, size, mtime_ns, extra]``; extra = link target or blob id.

    Blob ids are computed only for files the client listed with the same size but another mtime:
    the quick check (size + mtime, as rsync) settles the rest without reading them.
    """
    base = resolve(args["root"], args["path"])
    hdr = read_header()
    local = hdr.get("local") or {}
    skip_git = bool(args.get("skip_git"))
    try:
        st = os.lstat(base)
    except FileNotFoundError:
        return {"kind": "missing", "path": dec(base), "entries": []}

    def row(rel, path, st):
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            return [rel, "l", mode, st.st_size, st.st_mtime_ns, dec(os.readlink(path))]
        if stat.S_ISDIR(st.st_mode):
            return [rel, "d", mode, 0, st.st_mtime_ns, None]
        if not stat.S_ISREG(st.st_mode):
            return None  # sockets, fifos, devices: never synced
        extra = None
        want = local.get(rel)
        if want and want[0] == st.st_size and not same_mtime(want[1], st.st_mtime_ns):
            with contextlib.suppress(OSError):
                extra = file_oid(path, st.st_size)
        return [rel, "f", mode, st.st_size, st.st_mtime_ns, extra]

    if not stat.S_ISDIR(st.st_mode):
        r = row("", base, st)
        return {"kind": "file", "path": dec(base), "entries": [r] if r else []}
    entries = []
    stack = [(base, "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            it = list(os.scandir(directory))
        except OSError as exc:
            raise AgentError("cannot list %s: %s" % (dec(directory), exc.strerror), "remote") from None
        for de in it:
            name = dec(de.name)
            if skip_git and name == ".git":
                continue
            rel = prefix + name
            est = de.stat(follow_symlinks=False)
            r = row(rel, de.path, est)
            if r is None:
                continue
            entries.append(r)
            if r[1] == "d":
                stack.append((de.path, rel + "/"))
    entries.sort(key=lambda e: enc(e[0]))
    return {"kind": "dir", "path": dec(base), "entries": entries}


def mode_apply(args):
    base = resolve(args["root"], args["path"])
    plan = read_header()
    makedirs(base)

    def target(rel):
        return join(base, enc(check_relpath(rel)))

    done = {"deleted": 0, "uploaded": 0, "uploaded_bytes": 0, "bad": []}
    for rel in plan.get("delete", ()):
        p = target(rel)
        if os.path.lexists(p):
            force_rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
            done["deleted"] += 1
    for rel, mode, size, oid, mtime_ns in plan.get("upload", ()):
        p = target(rel)
        parent = os.path.dirname(p)
        makedirs(parent)
        tmp = temp_name(parent, "up")
        _cleanup.add(tmp)
        try:
            hasher = blob_hasher(size)
            receive_into(tmp, size, hasher)
            if hasher.hexdigest() != oid:
                done["bad"].append(rel)
                continue
            os.chmod(tmp, private(mode))
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
            if os.path.isdir(p) and not os.path.islink(p):
                force_rmtree(p)
            os.replace(tmp, p)
            done["uploaded"] += 1
            done["uploaded_bytes"] += size
        finally:
            _cleanup.discard(tmp)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if read_exact(1) != b"E":
        raise AgentError("corrupt push stream")
    for rel, link in plan.get("symlink", ()):
        p = target(rel)
        makedirs(os.path.dirname(p))
        if os.path.lexists(p):
            force_rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)
        os.symlink(enc(link), p)
    for rel, mode in plan.get("chmod", ()):
        os.chmod(target(rel), private(mode))
    for rel, mtime_ns in plan.get("touch", ()):
        os.utime(target(rel), ns=(mtime_ns, mtime_ns))
    for rel in sorted(plan.get("rmdir", ()), key=lambda r: -r.count("/")):
        with contextlib.suppress(OSError):
            os.rmdir(target(rel))  # not empty (something appeared since the scan): keep it
    return done


def mode_send(args):
    """Stream files for pull. Frames, in request order:

    ``F idx:4 size:8 mtime_ns:8 mode:4 <content> sha1:20 changed:1``  content follows
    ``S idx:4 mtime_ns:8 mode:4``  same content as the client's copy (its blob id matched)
    ``X idx:4 len:4 <message>``  could not be read
    then ``E``.
    """
    base = resolve(args["root"], args["path"])
    files = read_header()["files"]
    out = sys.stdout.buffer
    for idx, (rel, local_oid) in enumerate(files):
        path = base if rel == "" else join(base, enc(check_relpath(rel)))
        try:
            fh = open(path, "rb")
        except OSError as exc:
            msg = (exc.strerror or str(exc)).encode("utf-8", "replace")
            out.write(b"X" + struct.pack(">II", idx, len(msg)) + msg)
            continue
        with fh:
            st = os.fstat(fh.fileno())
            mode = stat.S_IMODE(st.st_mode)
            if local_oid and file_oid(path, st.st_size) == local_oid:
                out.write(b"S" + struct.pack(">IqI", idx, st.st_mtime_ns, mode))
                continue
            out.write(b"F" + struct.pack(">IQqI", idx, st.st_size, st.st_mtime_ns, mode))
            hasher = blob_hasher(st.st_size)
            left, changed = st.st_size, 0
            while left:
                data = fh.read(min(CHUNK, left))
                if not data:
                    data = b"\0" * min(CHUNK, left)  # shrank while read: keep the frame's length
                    changed = 1
                hasher.update(data)
                out.write(data)
                left -= len(data)
            if fh.read(1):
                changed = 1  # grew while read: the client gets the first `size` bytes and a warning
            out.write(hasher.digest() + bytes([changed]))
    out.write(b"E")
    out.flush()
    return None


MODES = {
    "snap-query": mode_snap_query,
    "snap-put": mode_snap_put,
    "scan": mode_scan,
    "apply": mode_apply,
    "send": mode_send,
}


def _on_signal(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv):
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _on_signal)
    mode, args = argv[1], json.loads(argv[2])
    global UMASK
    UMASK = int(args.get("umask", 0o077)) & 0o777
    os.umask(UMASK)
    try:
        if "root" in args and "umask" in args:
            # Only a client that states the policy narrows the root: one that sends no umask (an
            # older caller) still writes private files but must not undo share_with_group.
            protect_root(root_path(args["root"]))
        result = MODES[mode](args)
        if result is not None:
            reply(result)
        return 0
    except Truncated:
        sys.stderr.write("rv agent: input ended early (the client went away); partial files removed\n")
        return 3
    except AgentError as exc:
        reply({"error": str(exc), "code": exc.code})
        return 0
    except OSError as exc:
        if mode == "send":
            raise  # mid-stream: a reply here would corrupt the frames; the traceback goes to stderr
        where = exc.filename.decode("utf-8", "replace") if isinstance(exc.filename, bytes) else exc.filename
        name = errno.errorcode.get(exc.errno or 0, "")
        reply({"error": "%s: %s" % (exc.strerror or exc, where), "code": "oserror", "errno": name})
        return 0
    finally:
        for path in list(_cleanup):
            with contextlib.suppress(OSError):
                force_rmtree(path) if os.path.isdir(path) else os.unlink(path)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
