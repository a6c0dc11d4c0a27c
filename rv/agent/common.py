"""The agent's plumbing: errors, replies on stdout, paths under the remote root, private writes.

Private by default: every mode runs under the umask the client sends (077, or 027 when the profile
shares with the group), explicit modes are masked by it too, and the remote root itself is kept at
0700 (0750), so nothing under it is reachable by others even in a store written by an older rv.
Temporary files a mode registers in ``cleanup_paths`` are removed however the mode ends.
"""

import contextlib
import errno
import json
import os
import shutil
import stat
import struct
import sys
import threading
import time
import zlib

from rv.agent import manifest

CHUNK = 1 << 20

TMP_STALE_S = 3600  # temp files untouched this long belong to a dead upload


class AgentError(Exception):
    """A failure the client maps to an rv error: ``code`` names the kind."""

    def __init__(self, message, code="remote"):
        Exception.__init__(self, message)
        self.code = code


class Truncated(Exception):
    """stdin ended in the middle of a frame: the client went away."""


def check_relpath(path):
    """A manifest path: relative, no ``..``, no empty part, never inside ``.git``."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..", ".git") for p in parts):
        raise AgentError("refusing unsafe path %r" % path, "usage")
    return path


_stdin = None

# Temporary files and folders a mode made: removed however it ends (rv.agent.__main__ empties it).
cleanup_paths = set()

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
    return manifest.enc(os.path.expanduser(root))


def resolve(root, path):
    """Relative paths are under the remote root; ``~/...`` is the remote home; absolute is as is."""
    if path.startswith("~"):
        return manifest.enc(os.path.expanduser(path))
    if path.startswith("/"):
        return manifest.enc(path)
    return os.path.join(root_path(root), manifest.enc(path))


def join(*parts):
    return os.path.join(*parts)


def under(folder, *relpaths):
    """``folder``/``relpath``/...: paths of :mod:`rv.agent.layout` (text) under an agent's folder (bytes)."""
    return join(folder, *[manifest.enc(p) for p in relpaths])


# What parsing malformed JSON may raise: ValueError (UnicodeDecodeError is one), and RecursionError
# for text nested deeper than the parser recurses ([[[[...): one bad file or line is never a crash.
UNPARSABLE = (ValueError, RecursionError)


def read_json(path):
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read().decode("utf-8", "replace"))
    except (OSError,) + UNPARSABLE:
        return None


def read_bytes(path):
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return b""


def read_text(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return None


def write_json(path, obj, mode=0o600):
    write_atomic(path, (json.dumps(obj, indent=1) + "\n").encode("utf-8"), mode)


def tree_bytes(path):
    """(bytes on disk, newest mtime) of a file or folder."""
    total, newest = 0, 0.0
    try:
        st = os.lstat(path)
    except OSError:
        return 0, 0.0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512, st.st_mtime
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                st = os.lstat(join(dirpath, name))
                total += st.st_blocks * 512
                newest = max(newest, st.st_mtime)
    return total, newest


def makedirs(path, mode=0o755):
    try:
        os.makedirs(path, mode)
    except OSError as exc:
        if exc.errno != errno.EEXIST or not os.path.isdir(path):
            raise


_TEMP = [os.urandom(6).hex().encode(), 0]  # this process's random part, drawn once, and a serial

_TEMP_LOCK = threading.Lock()  # writer threads (rv.agent.store.Writers) take names too


def temp_name(directory, tag):
    """A name no other writer uses: the pid and a random salt for this process, then a serial
    (os.urandom per file showed in profiles of a 50,000-file upload)."""
    with _TEMP_LOCK:
        _TEMP[1] += 1
        serial = _TEMP[1]
    name = b".rv-tmp-" + manifest.enc(tag) + b"-%d-" % os.getpid() + _TEMP[0] + b"-%d" % serial
    return join(directory, name)


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


def write_atomic(path, data, mode):
    directory = os.path.dirname(path)
    tmp = temp_name(directory, "meta")
    cleanup_paths.add(tmp)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, private(mode))
        os.replace(tmp, path)
    finally:
        cleanup_paths.discard(tmp)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def receive_into(tmp, size, hasher, mode=0o600):
    """Copy ``size`` bytes of stdin into a new file ``tmp`` (created with ``mode``), feeding ``hasher``."""
    left = size
    # Created with its final mode, written through the bare descriptor: no chmod after, and no
    # buffered-file object per file (tens of thousands of small objects on a first sync).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, private(mode))
    try:
        while left:
            data = stdin().read(min(CHUNK, left))
            if not data:
                raise Truncated()
            hasher.update(data)
            write_all(fd, data)
            left -= len(data)
    finally:
        os.close(fd)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def remove_counted(path, freed, dry):
    freed.note(path)
    if dry:
        return
    if os.path.isdir(path) and not os.path.islink(path):
        force_rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remove_stale(folder, prefix, older_than):
    """Remove what is named ``prefix``... in ``folder`` and untouched for ``older_than`` seconds: the
    temp files and folders of a call killed before it could remove its own."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.startswith(prefix):
                path = join(folder, name)
                with contextlib.suppress(OSError):
                    if now - os.lstat(path).st_mtime > older_than:
                        force_rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(
                            path
                        )


# A cache entry's (an environment's, a pulled image's) use stamp: gc keeps what was used lately.
LAST_USED = b".last-used"


def touch(path):
    with contextlib.suppress(OSError):
        with open(path, "ab"):
            pass
        os.utime(path, None)


def cache_entries(base, read_meta, made_key):
    """[{key, path, meta, last_used}] of the whole entries of the cache folder ``base`` (those
    ``read_meta`` gives a record for), newest use first; an entry never stamped counts from its
    record's ``made_key`` time."""
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = join(base, name)
        if name.startswith(b".") or not os.path.isdir(path):
            continue
        meta = read_meta(path)
        if meta is None:
            continue
        try:
            last = os.stat(join(path, LAST_USED)).st_mtime
        except OSError:
            last = meta.get(made_key, 0)
        out.append({"key": manifest.dec(name), "path": manifest.dec(path), "meta": meta, "last_used": last})
    out.sort(key=lambda e: -e["last_used"])
    return out


def human_age(seconds):
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return "%d%s" % (seconds // size, unit)
    return "%ds" % seconds
