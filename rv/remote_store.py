"""The cluster-side half of snapshots and sync: a small stdlib-only program rv ships on every call.

rv never installs anything on the cluster. Each remote step runs this file's source, compressed, as
``python3 -c ... MODE ARGS`` over the one SSH connection (see :func:`rv.snapshot.agent_command`);
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


def manifest_id(entries):
    """The snapshot id: a hash of the sorted manifest ``[[path, mode, oid, size], ...]``."""
    data = json.dumps([list(e) for e in entries], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(b"rv-snapshot-1\n" + data.encode("ascii")).hexdigest()[:24]


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


def receive_into(tmp, size, hasher):
    """Copy ``size`` bytes of stdin into a new file ``tmp``, feeding ``hasher``."""
    left = size
    with open(tmp, "wb") as fh:
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


def snapshot_dir(root, sid):
    if not re.match(r"^[0-9a-f]{24}$", sid):
        raise AgentError("bad snapshot id %r" % sid, "usage")
    return join(root, b"snapshots", enc(sid))


def read_meta(root, sid):
    with open(snapshot_dir(root, sid) + b".json", "rb") as fh:
        return json.loads(fh.read().decode("ascii"))


def resolve_entries(root, sid, payload):
    """The manifest from a full list or a delta against a base snapshot; None if the base is gone.

    Returns ``(entries, new)``: ``new`` holds the entries that may need objects. With a delta against
    a base whose tree exists, that is only the upserted ones: the base's objects are referenced by
    it, and gc cannot remove them while the caller holds the store lock.
    """
    if "entries" in payload:
        entries = new = payload["entries"]
    else:
        try:
            base = read_meta(root, payload["base"])["entries"]
        except (OSError, ValueError, KeyError):
            return None, None
        by_path = dict((e[0], e) for e in base)
        for path in payload.get("remove", ()):
            by_path.pop(path, None)
        new = payload.get("upsert", [])
        for e in new:
            by_path[e[0]] = e
        entries = list(by_path.values())
        if not os.path.isdir(snapshot_dir(root, payload["base"])):
            new = entries
    entries = sort_entries(entries)
    if manifest_id(entries) != sid:
        if "entries" in payload:
            raise AgentError("the manifest sent does not hash to snapshot id %s" % sid, "remote")
        return None, None  # the base's manifest differs from the client's cached copy: ask for all
    for e in new:
        check_relpath(e[0])
        if e[1] not in (MODE_FILE, MODE_EXEC, MODE_LINK) or not re.match(r"^[0-9a-f]{40}$", e[2]):
            raise AgentError("bad manifest entry %r" % (e,), "usage")
    return entries, new


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
        final = snapshot_dir(root, sid)
        if os.path.isdir(final):
            touch(final + b".json")  # "last used": gc measures age from here
            return {"status": "exists"}
        entries, new = resolve_entries(root, sid, payload)
        if entries is None:
            return {"status": "need-full"}
        missing = missing_objects(root, new)
        return {"status": "missing", "missing": sorted(missing), "bytes": sum(missing.values())}


def receive_objects(root):
    """Read ``O <oid:20> <size:8> <content>`` frames until ``E``; each lands by rename when correct."""
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
        tmp = temp_name(tmpdir, oid)
        _cleanup.add(tmp)
        try:
            hasher = blob_hasher(size)
            receive_into(tmp, size, hasher)
            if hasher.hexdigest() == oid:
                os.chmod(tmp, private(0o444))
                dest = object_path(root, oid)
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


def build_snapshot(root, sid, entries, provenance):
    snaps = join(root, b"snapshots")
    makedirs(snaps)
    final = snapshot_dir(root, sid)
    build = join(snaps, b".tmp-" + enc(sid) + b"-%d-" % os.getpid() + os.urandom(4).hex().encode())
    _cleanup.add(build)
    try:
        os.mkdir(build, 0o700)
        made = set()
        for path, mode, oid, _size in entries:
            pb = enc(path)
            parts = pb.split(b"/")
            for i in range(1, len(parts)):
                d = b"/".join(parts[:i])
                if d not in made:
                    os.mkdir(join(build, d), 0o755)
                    made.add(d)
            dst = join(build, pb)
            if mode == MODE_LINK:
                with open(object_path(root, oid), "rb") as fh:
                    os.symlink(fh.read(), dst)
            elif mode == MODE_EXEC:
                link_or_copy(exec_object(root, oid), dst, 0o555)
            else:
                link_or_copy(object_path(root, oid), dst, 0o444)
        for d in made:
            os.chmod(join(build, d), private(0o555))
        os.chmod(build, private(0o555))
        meta = {
            "version": VERSION,
            "id": sid,
            "created": time.time(),
            "entries": entries,
            "provenance": provenance,
        }
        write_atomic(final + b".json", json.dumps(meta, ensure_ascii=True).encode("ascii"), 0o444)
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


def mode_snap_put(args):
    root = root_path(args["root"])
    payload = read_header()
    sid = payload["id"]
    clean_stale_temps(root)
    with store_lock(root, exclusive=False):
        received, received_bytes, bad = receive_objects(root)
        result = {"received": received, "received_bytes": received_bytes, "bad": bad}
        final = snapshot_dir(root, sid)
        if os.path.isdir(final):
            touch(final + b".json")
            result["status"] = "exists"
            return result
        entries, new = resolve_entries(root, sid, payload)
        if entries is None:
            result["status"] = "need-full"
            return result
        missing = missing_objects(root, new)
        if missing:
            result.update(status="missing", missing=sorted(missing))
            return result
        result["status"] = build_snapshot(root, sid, entries, payload.get("provenance"))
        return result


# -- garbage collection ----------------------------------------------------------------------------
# The runs side (rv.job.remote, mode "gc") decides which runs stay and calls this with the snapshots
# they use; ``freed`` counts, inode by inode, what each removal frees.


def collect_garbage(root, in_use, args, freed, dry):
    """Snapshots no kept run uses and unused for ``older_than``, then objects no kept snapshot needs."""
    older_than = float(args["older_than"])
    grace = float(args.get("grace", 900))
    report = {"removed": [], "kept": [], "objects_removed": 0}
    warnings = []
    snaps = join(root, b"snapshots")
    with store_lock(root, exclusive=True, wait=float(args.get("lock_wait", 120))):
        now = time.time()
        names = os.listdir(snaps) if os.path.isdir(snaps) else []
        kept_ids = []
        for name in sorted(names):
            path = join(snaps, name)
            if name.startswith(b".tmp-"):
                if now - os.lstat(path).st_mtime > STALE_BUILD_S:
                    remove_counted(path, freed, dry)
                continue
            if name.endswith(b".json") or not os.path.isdir(path):
                continue
            sid = dec(name)
            meta = path + b".json"
            used = os.lstat(meta).st_mtime if os.path.exists(meta) else os.lstat(path).st_mtime
            age = now - used
            row = {"id": sid, "age_s": round(age)}
            if sid in in_use:
                row["reason"] = "used by a run that is kept"
            elif age < max(older_than, grace):
                row["reason"] = "used %s ago" % human_age(age)
            if "reason" in row:
                report["kept"].append(row)
                kept_ids.append(sid)
                continue
            before = freed.bytes
            remove_counted(path, freed, dry)
            if os.path.exists(meta):
                remove_counted(meta, freed, dry)
            row["bytes"] = freed.bytes - before
            report["removed"].append(row)
        # Manifests left without their tree (a build that died between the two renames).
        for name in names:
            p = join(snaps, name)
            orphan = name.endswith(b".json") and not os.path.isdir(p[:-5]) and os.path.exists(p)
            if orphan and now - os.lstat(p).st_mtime > grace:
                remove_counted(p, freed, dry)
        referenced = set()
        for sid in kept_ids:
            try:
                referenced.update(e[2] for e in read_meta(root, sid)["entries"])
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
