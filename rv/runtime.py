"""The private folder where rv's background processes keep their sockets, pid and log files, and
how those processes are started.

Shared by the warm connections (rv.remote.warm) and the command server (rv.entry, rv.forkserver). Imports
only what Python has loaded before any of rv: the command server's client reads this on every
command, before anything else is imported.
"""

from __future__ import annotations

import os
import stat
import sys

TYPE_CHECKING = False  # typing's own costs the front end an import; mypy reads any TYPE_CHECKING
if TYPE_CHECKING:
    import subprocess

# Signals the `rv` front end passes on to its served command (rv.entry), and which stay blocked in
# the command's copy until it is ready to take them (rv.forkserver): a Ctrl-C typed in the first
# milliseconds ends the command as one typed later does, never half-way through its setting up.
# SIGTSTP also stops the front end.
FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGWINCH", "SIGCONT", "SIGUSR1", "SIGUSR2")
FORWARDED_AND_STOP = (*FORWARDED_SIGNALS, "SIGTSTP")

# The first field of every request to the command server (rv.entry.encode_request,
# rv.forkserver.decode_request): a server of another rv version refuses what it cannot read.
COMMAND_PROTOCOL = b"rv-entry-1"


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


def child_path() -> dict[str, object]:
    """Where a background Python started by spawn_python finds what this one imports.

    ``path``: this process's search path, made absolute (the child starts in /). ``user_site``: the
    user's site-packages when this process read it (a ``pip install --user``): the child runs its
    ``.pth`` files too. The system site's ``.pth`` files (a venv's) the child reads itself, as Python
    does at every start: an import hook installed there (``pip install -e .``'s
    ``__editable___rv_*_finder``) is how this process found rv, and can be the only way.
    """
    import site

    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return {
        "path": [os.path.abspath(p) for p in sys.path],
        "user_site": user if user and user in sys.path else None,
    }


# The first statements of every BOOT given to spawn_python: the data, then the search path.
BOOT_PREFIX = (
    "import json,sys;d=json.loads(sys.stdin.buffer.read());"
    "d['user_site'] and __import__('site').addsitedir(d['user_site']);sys.path[:]=d['path'];"
)


def command_server_key() -> str:
    """Which command server may run this process's commands: same interpreter, same search path,
    same rv. (The server also compares the files of its rv package on every request: an edit since
    it started makes it stale.)"""
    import zlib

    here = os.path.dirname(os.path.abspath(__file__))
    # sys.path[0] is the folder of the script that started Python: not part of what is imported.
    ident = "\0".join([sys.executable, here, *sys.path[1:]])
    return f"{zlib.crc32(ident.encode('utf-8', 'surrogateescape')):08x}"


def command_socket(folder: str, key: str) -> str:
    """The command server's socket for ``key`` in the runtime ``folder`` (its .pid, .log and .lock
    files share the name)."""
    return os.path.join(folder, f"cmd-{key}.sock")


def spawn_python(
    boot: str,
    data: dict[str, object],
    *,
    args: tuple[str, ...] = (),
    pass_fds: tuple[int, ...] = (),
    log: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``python -I -c BOOT_PREFIX+BOOT ARGS...`` in a session of its own, in /, with ``data``
    (and child_path()'s keys) as JSON on its stdin, and return at once.

    ``-I``: no PYTHON* variables and no user site from the environment; the search path comes in
    ``data``, as does anything else: never on the command line, which others see. Site processing
    stays on (no ``-S``, unless this process runs without it): an editable install's import hook
    lives in a ``.pth`` file. What the child writes on stdout and stderr before it has a log of its
    own (an import that fails) goes to ``log``, else nowhere."""
    import json
    import subprocess

    flags = ["-I", "-S"] if sys.flags.no_site else ["-I"]
    out = open_log(log) if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            [sys.executable, *flags, "-c", BOOT_PREFIX + boot, *args],
            pass_fds=pass_fds,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            start_new_session=True,
            cwd="/",
        )
    finally:
        if isinstance(out, int) and out >= 0:
            os.close(out)
    assert proc.stdin is not None
    with proc.stdin:
        proc.stdin.write(json.dumps({**data, **child_path()}).encode())
    return proc


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
