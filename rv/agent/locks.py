"""Locks under the remote root: flock where the filesystem has it, an atomic mkdir where it does not.

flock where the filesystem has it: the kernel drops it when its holder dies. Some Lustre and NFS
mounts answer flock with ENOLCK, EOPNOTSUPP or ENOSYS; there an atomic mkdir takes its place, with a
note of who holds it, taken over once the holder is gone (same host, dead pid) or the note is older
than ``stale`` seconds. Either way a busy lock names its holder.
"""

import contextlib
import errno
import fcntl
import json
import os
import shutil
import time

from rv.agent import common, layout, manifest

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
    return common.AgentError(
        "%s is busy: held by %s; try again when it is done" % (manifest.dec(path), holder), "busy"
    )


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
    note = common.join(lock_dir, b"holder")
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
    common.makedirs(os.path.dirname(path), 0o700)
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
    return lock(common.under(root, layout.store_lock()), what, exclusive=exclusive, wait=wait)
