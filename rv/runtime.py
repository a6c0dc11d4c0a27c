"""The private folder where rv's background processes keep their sockets, pid and log files.

Shared by the warm connections (rv.warm) and the command server (rv.entry, rv.forkserver). Imports
only what Python has loaded before any of rv: the command server's client reads this on every
command, before anything else is imported.
"""

from __future__ import annotations

import os
import stat


class NotPrivate(Exception):
    """The folder exists but others could reach it (or it is not ours): keep nothing there."""


def _temp_root() -> str:
    # tempfile.gettempdir()'s choice, without importing tempfile (random, shutil, ...).
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = os.environ.get(name)
        if value and os.path.isdir(value):
            return value
    return "/tmp"


def runtime_dir() -> str:
    """``$RV_RUNTIME_DIR``, ``$XDG_RUNTIME_DIR/rv``, else ``/tmp/rv-<uid>``: made if missing, and
    checked to be a folder of this user that only this user can enter (else NotPrivate)."""
    if os.environ.get("RV_RUNTIME_DIR"):
        path = os.environ["RV_RUNTIME_DIR"]
    elif os.environ.get("XDG_RUNTIME_DIR") and os.path.isdir(os.environ["XDG_RUNTIME_DIR"]):
        path = os.path.join(os.environ["XDG_RUNTIME_DIR"], "rv")
    else:
        path = os.path.join(_temp_root(), f"rv-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        # Someone else's folder, a symlink, or one others can enter: their processes could reach
        # our sockets (or plant one).
        raise NotPrivate(f"{path} is not a private folder of this user (mode {st.st_mode & 0o777:o})")
    return path


def spawn_python(
    boot: str, data: object, *, args: tuple[str, ...] = (), pass_fds: tuple[int, ...] = ()
) -> None:
    """Start ``python -I -S -c BOOT ARGS...`` in a session of its own, in /, with no stdio but
    ``data`` as JSON on its stdin, and return at once. ``-I -S``: no site processing (a venv's .pth
    files, an editable install's finder) and no PYTHON* variables; whatever search path the process
    needs comes in ``data``, as does anything else: never on the command line, which others see."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", boot, *args],
        pass_fds=pass_fds,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        cwd="/",
    )
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(json.dumps(data).encode())


def write_pid(path: str) -> None:
    """This process's pid in ``path`` (0600), replaced atomically: a reader never sees half of it."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(tmp, path)


def open_log(path: str, limit: int = 1 << 20) -> int:
    """A background process's log (0600), appended to (a process on its way out may still write
    there) and cut when it has grown past ``limit``."""
    try:
        if os.path.getsize(path) > limit:
            os.truncate(path, 0)
    except OSError:
        pass  # not there yet: created below
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def peer_uid(conn: object) -> int | None:
    """The uid of the process at the other end of a Unix socket; None where the system does not
    say (there the folder's 0700 is the guard)."""
    import socket
    import struct

    if not hasattr(socket, "SO_PEERCRED"):
        return None
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))  # type: ignore[attr-defined]
    return int(struct.unpack("3i", raw)[1])
